"""The test's Proxmox: fakepve (a real HTTPS server speaking the PVE API from
Proxmox's own schema) with what the provisioning job relies on and fakepve
does not model. Test-only: fakepve is AGPL-3.0 and never imported by product
code (test_license.py checks).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import asyncssh
from fakepve import FakePve, PveError, TaskError
from fakepve.certs import make_cert
from fakepve.qemu import split_drive

TOKEN_ID = "llmgw@pve!prov"
TOKEN_SECRET = "9f1c2b7e-4d5a-4e8b-a1c3-5e6f7a8b9c0d"
IMAGE = "local:import/noble.qcow2"


class TestPve(FakePve):
    """fakepve plus: the import-from rules (an API token can never import
    from an absolute path; the source volume must exist and be auditable),
    a disk resize that changes the disk, a latency on every task, and a gate
    that holds resize requests (to kill a worker inside one)."""

    __test__ = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # PVE seconds every task takes (scaled by time_scale).
        self.task_secs = 0.0
        # When set: resize requests wait for it (an asyncio.Event).
        self.resize_gate: asyncio.Event | None = None
        self.resize_seen = threading.Event()
        # When set: creates wait until this many have arrived (an asyncio.Barrier).
        self.create_barrier: asyncio.Barrier | None = None

    def _routes_testpve(self):
        return [("PUT", "/nodes/{node}/qemu/{vmid}/resize", self._qm_resize)]

    async def task(self, node, ttype, tid, user, body, vm=None, lock=True, log=()):
        async def slow_body():
            await self.pause(self.task_secs)
            return await body()

        return await super().task(node, ttype, tid, user, slow_body, vm=vm, lock=lock, log=log)

    async def _qm_create(self, v, user):
        if self.create_barrier is not None:
            await self.create_barrier.wait()
        for key, value in v.items():
            if not key.startswith(("scsi", "virtio", "sata", "ide")):
                continue
            _volume, props = split_drive(str(value))
            source = props.get("import-from")
            if not source:
                continue
            if source.startswith("/"):
                if user != "root@pam":
                    raise PveError(403, f"Permission check failed (only root@pam may import from an absolute path: {source})")
                continue
            sid, _, name = source.partition(":")
            self.require(user, f"/storage/{sid}", "Datastore.Audit")
            if name not in self.storages.get(sid, {}).get("volumes", {}):
                raise PveError(500, f"unable to create VM {v['vmid']} - volume '{source}' does not exist")
        return await super()._qm_create(v, user)

    async def _qm_resize(self, v, user):
        vm = self.find(v["node"], v["vmid"])
        self.require(user, f"/vms/{vm.vmid}", "VM.Config.Disk")
        self.resize_seen.set()
        if self.resize_gate is not None:
            await self.resize_gate.wait()
        disk, size = v["disk"], str(v["size"])
        if disk not in vm.config:
            raise PveError(500, f"disk '{disk}' does not exist")

        async def body():
            volume, props = split_drive(vm.config[disk])
            props = {k: val for k, val in props.items() if k != "import-from"}
            props["size"] = size
            vm.config[disk] = ",".join([volume] + [f"{k}={props[k]}" for k in sorted(props)])

        return await self.task(vm.node, "resize", vm.vmid, user, body, vm=vm)


class Loop:
    """An event loop in a thread, for the servers the tests run."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def pve_make(directory: Path) -> tuple[TestPve, str]:
    """A TestPve (not started) with a token, an import volume and its own
    certificate; returns it and the certificate's path (the CA to trust)."""
    cert, key, _der = make_cert(str(directory), hosts=("127.0.0.1",))
    pve = TestPve(host="127.0.0.1", port=0)
    pve.apitokens[TOKEN_ID] = TOKEN_SECRET
    pve.storages["local"]["content"] = "iso,vztmpl,backup,import"
    pve.store_file("local", "noble.qcow2", 600 * 1024**2, content="import")
    pve.certfile, pve.keyfile = cert, key
    return pve, cert


async def ssh_server(host: str, port: int):
    """A minimal SSH server: all the job needs is its host key."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.listen(host, port, server_host_keys=[key], reuse_address=True)
    return server, key.export_public_key("openssh").decode().strip()


__all__ = ["IMAGE", "TOKEN_ID", "TOKEN_SECRET", "Loop", "TaskError", "TestPve", "pve_make", "ssh_server"]
