// The cluster grid's live update: every few seconds, fetch the grid as
// compact data (/cluster/grid.json, described in ui/cluster_live.py) and
// render the markup the server renders (ui/cluster.py, the partial
// cluster_grid.html), so that the page reads the same after an update:
// one <span> per GPU with its title, a card per node. The filters form
// still swaps the server's HTML partial in through htmx.
(function () {
  "use strict";
  var PALETTE = 12;
  var EVERY_MS = 3000;

  function esc(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#x27;");
  }

  // One GPU's token: "<replica id, base 36>~<letter><value>...": see ui/cluster_live.py.
  // Letters: m missing since, c claimants (joined by +), q quarantined, d degraded (with the reason).
  function parseGpu(token) {
    var parts = token.split("~");
    var gpu = {replica: parts[0] === "" ? null : parseInt(parts[0], 36), attrs: {}};
    for (var i = 1; i < parts.length; i++) {
      gpu.attrs[parts[i].charAt(0)] = parts[i].slice(1);
    }
    return gpu;
  }

  // "0".."4": the GPU's utilisation in fifths (class u0..u4); "-" or nothing: no fresh reading.
  function busyText(fifth) {
    return fifth >= 4 ? "80\u2013100% busy" : (fifth * 20) + "\u2013" + (fifth * 20 + 19) + "% busy";
  }

  // As ui/cluster.py renders a cell (cluster_grid's loop and _marked_cell).
  function gpuCell(data, index, gpu) {
    var model = gpu.replica === null ? null : data.models[data.replicas[gpu.replica.toString(36)]];
    var colour = gpu.replica === null ? "free" : "r" + (gpu.replica % PALETTE);
    var missing = gpu.attrs.m, claimants = gpu.attrs.c;
    var health = gpu.attrs.q !== undefined ? ["quarantined", gpu.attrs.q] :
      gpu.attrs.d !== undefined ? ["degraded", gpu.attrs.d] : null;
    var util = gpu.columns[0];
    var fifth = util !== undefined && util >= "0" && util <= "4" ? parseInt(util, 10) : null;
    if (missing === undefined && claimants === undefined && health === null) {
      if (fifth !== null) {
        return '<span class="gpu ' + colour + " u" + fifth + '" title="' +
          esc((gpu.replica === null ? "GPU " + index + ": free" : model + " #" + gpu.replica + ", GPU " + index) +
              ", " + busyText(fifth)) + '"></span>';
      }
      if (gpu.replica === null) {
        return '<span class="gpu free" title="GPU ' + index + ': free"></span>';
      }
      return '<span class="gpu ' + colour + '" title="' + esc(model + " #" + gpu.replica + ", GPU " + index) + '"></span>';
    }
    var classes = "gpu " + colour;
    var title = "GPU " + index + ": " + (gpu.replica === null ? "free" : model + " #" + gpu.replica);
    if (fifth !== null) {
      classes += " u" + fifth;
      title += ", " + busyText(fifth);
    }
    if (missing !== undefined) {
      classes += " missing";
      title += "; missing since " + missing;
    }
    if (claimants !== undefined) {
      classes += " conflict";
      title += "; also claimed by " + claimants.split("+").join(", ");
    }
    if (health !== null) {
      classes += " " + health[0];
      title += "; " + health[0] + ": " + decodeURIComponent(health[1]);
    }
    return '<span class="' + classes + '" title="' + esc(title) + '"></span>';
  }

  function card(data, line, nodeUrl) {
    var fields = line.split("|");
    var name = fields[0], status = fields[1], age = fields[2];
    var more = data.extra[name] || {};
    var version = more.v || fields[3];
    var tokens = fields[4] === "" ? [] : fields[4].split(",");
    var meta = '<span title="last heartbeat">\u2665 ' + esc(age) + "</span>";
    if (version) meta += "<span>agent " + esc(version) + "</span>";
    if (more.d && status !== "draining") meta += '<span class="badge st-draining">draining</span>';
    if (more.o) meta += "<span>also " + esc(more.o.join(", ")) + "</span>";
    var errors = "";
    if (more.e) {
      var first = Array.from(more.e[0]);
      errors = '<div class="errors" title="' + esc(more.e.join("; ")) + '">\u26a0 ' + more.e.length +
        " discovery error" + (more.e.length > 1 ? "s" : "") + ": " +
        esc(first.slice(0, 60).join("") + (first.length > 60 ? "\u2026" : "")) + "</div>";
    }
    (more.w || []).forEach(function (w) { errors += '<div class="errors">\u26a0 ' + esc(w) + "</div>"; });
    // Fields after the GPUs are per-GPU columns, one character per GPU (ui/cluster_live.py).
    var columns = fields.slice(5);
    var cells = tokens.map(function (token, index) {
      var gpu = parseGpu(token);
      gpu.columns = columns.map(function (column) { return column.charAt(index); });
      return gpuCell(data, index, gpu);
    }).join("");
    return '<article class="node ' + esc(status) + (more.d ? " draining" : "") + '" data-node="' + esc(name) +
      '"><header><a href="' + esc(nodeUrl + encodeURIComponent(name)) + '/">' + esc(name) + "</a>" +
      '<span class="badge st-' + esc(status) + '">' + esc(status) + "</span></header>" +
      '<div class="meta">' + meta + "</div>" + errors + '<div class="gpus">' + cells + "</div></article>";
  }

  function render(data, nodeUrl) {
    var totals = data.totals.map(function (t) {
      return '<span class="badge st-' + esc(t[0]) + '">' + t[1] + " " + esc(t[0]) + "</span> ";
    }).join("") || "No node has registered yet: start an agent (docs/agent.md).";
    var legend = '<span><i class="swatch free"></i> free GPU</span>' +
      '<span><i class="swatch free missing"></i> missing GPU</span>' +
      '<span><i class="swatch free conflict"></i> GPU claimed by two nodes</span>' +
      data.legend.map(function (e) {
        return '<span><i class="swatch r' + (e[0] % PALETTE) + '"></i> ' + esc(e[1] + " #" + e[0]) + "</span>";
      }).join("") +
      (data.legend_more ? '<span class="muted">and ' + data.legend_more +
        " more replicas (hover a GPU for its model)</span>" : "");
    var fabrics = data.fabrics.map(function (f) {
      var counts = f.counts.map(function (c) { return c[1] + " " + esc(c[0]); }).join(", ");
      var nodes = "";
      if (!f.collapsed) {
        nodes = '<div class="nodes">' + (f.nodes.map(function (line) { return card(data, line, nodeUrl); }).join("") ||
          '<p class="muted">No node matches.</p>') + "</div>";
      }
      return '<section class="fabric' + (f.collapsed ? " collapsed" : "") + '" aria-label="fabric ' + esc(f.name) +
        '" data-fabric="' + esc(f.name) + '"><header><h2>' + esc(f.name) + '</h2><span class="counts">' + counts +
        "</span></header>" + nodes + "</section>";
    }).join("");
    return '<p class="muted" aria-live="polite">' + totals + "</p>" +
      '<div class="legend" aria-label="legend">' + legend + "</div>" +
      '<div class="fabrics">' + fabrics + "</div>";
  }

  function query() {
    var form = document.getElementById("filters");
    return form ? new URLSearchParams(new FormData(form)).toString() : "";
  }

  var busy = false;

  function refresh() {
    var grid = document.getElementById("grid");
    if (!grid || !grid.dataset.live || busy || document.hidden) return Promise.resolve(false);
    busy = true;
    var url = grid.dataset.live + "?" + query();
    // As htmx's polling did: a session that ended sends the page to the login.
    return fetch(url, {headers: {"HX-Request": "true", "HX-Current-URL": window.location.href},
                       credentials: "same-origin"})
      .then(function (response) {
        var redirect = response.headers.get("HX-Redirect");
        if (redirect) {
          window.location.assign(redirect);
          return false;
        }
        if (!response.ok) return false;
        return response.json().then(function (data) {
          var now = document.getElementById("grid");
          if (now !== grid) return false;  // the filters swapped a new grid in meanwhile
          grid.innerHTML = render(data, grid.dataset.nodeUrl);
          return true;
        });
      })
      .catch(function () { return false; })
      .finally(function () { busy = false; });
  }

  window.llmgwCluster = {refresh: refresh, render: render};
  setInterval(refresh, EVERY_MS);
})();
