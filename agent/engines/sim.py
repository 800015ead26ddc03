"""A simulated multi-node engine: the launch sequence of vLLM or SGLang without GPUs.

    python -m agent.engines.sim --rank R --nnodes N --rendezvous HOST:PORT \\
        --host H --port P --model NAME --fabric F [performance model flags]

The leader's answers take the time an engine would (``sim_model``: a batch
limit, a prefix KV cache, prefill and decode times), with flags named as
vLLM's where vLLM has them: ``--max-num-seqs``, ``--block-size``,
``--num-gpu-blocks-override``, ``--max-model-len``,
``--[no-]enable-prefix-caching``, and the sim's own ``--prefill-overhead``,
``--prefill-time-per-token``, ``--decode-step-base``,
``--decode-step-per-seq`` (seconds) and ``--token-delay`` (flat timing).

Rank 0, the leader, binds the rendezvous port and waits until every worker
(ranks 1..N-1) has joined; only then does it bind its HTTP port and serve
(see ``sim_api``). Workers connect to the rendezvous and never listen on
anything. Each member states its fabric when it joins: if they differ, the
group forms and then hangs, as NCCL's first all-reduce does across two
fabrics, and the leader never serves. Once a group exists, a member that
goes away (exits, is killed, stops answering pings) breaks it, and every
member exits non-zero, as a real engine does when NCCL fails.

Exit status: 0 when stopped by SIGTERM/SIGINT; 1 when the group broke or the
HTTP port could not be bound; 2 when the leader refused this worker; 3 when
the group did not form within ``--join-timeout``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from .sim_api import LOAD, SimModel, make_server, serve_in_thread
from .sim_model import DEFAULT_NUM_GPU_BLOCKS, SimParams

logger = logging.getLogger("llmgw.sim")

EXIT_STOPPED, EXIT_BROKEN, EXIT_REFUSED, EXIT_TIMEOUT = 0, 1, 2, 3
PING_EVERY = 1.0


def _exit(code: int, message: str) -> None:
    # os._exit: the HTTP server's and the peers' threads must not keep a
    # broken member alive.
    (logger.info if code == EXIT_STOPPED else logger.error)("%s; exiting with status %d", message, code)
    logging.shutdown()
    os._exit(code)


class Peer:
    """One end of a rendezvous connection: JSON lines, pings, a silence limit."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8")
        self._write_lock = threading.Lock()

    def send(self, **message) -> None:
        with self._write_lock:
            self.sock.sendall((json.dumps(message) + "\n").encode())

    def receive(self) -> dict:
        """The next message other than a ping. Raises ConnectionError when the peer is gone."""
        while True:
            try:
                line = self.reader.readline()
            except (TimeoutError, OSError) as exc:
                raise ConnectionError(f"silent or reset ({exc or type(exc).__name__})") from exc
            if not line:
                raise ConnectionError("closed the connection")
            try:
                message = json.loads(line)
            except ValueError as exc:
                raise ConnectionError(f"sent garbage: {line[:80]!r}") from exc
            if message.get("op") != "ping":
                return message

    def keep_pinging(self, on_failure) -> None:
        def loop() -> None:
            while True:
                time.sleep(PING_EVERY)
                try:
                    self.send(op="ping")
                except OSError as exc:
                    on_failure(exc)
                    return

        threading.Thread(target=loop, name="ping", daemon=True).start()


# --- the leader ------------------------------------------------------------------------


class Leader:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nnodes = args.nnodes
        self.workers: dict[int, tuple[Peer, str]] = {}  # rank -> (peer, fabric)
        self.lock = threading.Lock()
        self.all_joined = threading.Event()

    def run(self) -> None:
        if self.nnodes > 1:
            host, port = _split_addr(self.args.rendezvous)
            listener = socket.create_server((host, port))
            logger.info("rank 0 waiting for %d worker(s) on rendezvous %s:%d", self.nnodes - 1, host, port)
            threading.Thread(target=self._accept, args=(listener,), name="rendezvous", daemon=True).start()
            if not self.all_joined.wait(self.args.join_timeout):
                _exit(EXIT_TIMEOUT, f"only {len(self.workers)} of {self.nnodes - 1} worker(s) joined "
                      f"within {self.args.join_timeout:g}s")
        fabrics = {0: self.args.fabric, **{rank: fabric for rank, (_, fabric) in self.workers.items()}}
        with self.lock:
            for peer, _ in self.workers.values():
                peer.send(op="formed", nnodes=self.nnodes)
        logger.info("group formed: %d member(s), fabrics %s", self.nnodes, _describe(fabrics))
        if len(set(fabrics.values())) > 1:
            # What NCCL does here is hang in the first collective, with
            # every process alive and nothing served. So do we.
            logger.warning("first all-reduce spans fabrics %s and will never complete", _describe(fabrics))
            _forever()
        self._serve()

    def _serve(self) -> None:
        model = SimModel(self.args.model, self.args.params)
        try:
            server = make_server(self.args.host, self.args.port, model)
            LOAD.keep_writing()  # in the member's working directory, for the fake NVML
        except OSError as exc:
            _exit(EXIT_BROKEN, f"cannot serve HTTP on {self.args.host}:{self.args.port}: {exc}")
        logger.info("serving model %s on http://%s:%d", model.name, self.args.host, self.args.port)
        serve_in_thread(server)
        _forever()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            sock, addr = listener.accept()
            threading.Thread(target=self._join, args=(sock, addr), name="join", daemon=True).start()

    def _join(self, sock: socket.socket, addr) -> None:
        peer = Peer(sock, self.args.peer_timeout)
        try:
            hello = peer.receive()
        except ConnectionError:
            sock.close()
            return
        rank, reason = hello.get("rank"), self._refusal(hello)
        if reason:
            logger.warning("refused a worker from %s:%d: %s", addr[0], addr[1], reason)
            try:
                peer.send(op="refused", reason=reason)
            finally:
                sock.close()
            return
        with self.lock:
            self.workers[rank] = (peer, str(hello.get("fabric") or ""))
            joined = len(self.workers)
            peer.send(op="welcome", joined=joined, nnodes=self.nnodes)
        logger.info("rank %d joined from %s (fabric %s); %d of %d worker(s)",
                    rank, addr[0], hello.get("fabric") or "none", joined, self.nnodes - 1)
        peer.keep_pinging(lambda exc: _exit(EXIT_BROKEN, f"group broken: lost rank {rank} ({exc})"))
        if joined == self.nnodes - 1:
            self.all_joined.set()
        try:
            message = peer.receive()
            reason = f"rank {rank} sent {message.get('op')!r} unexpectedly"
        except ConnectionError as exc:
            reason = f"rank {rank} {exc}"
        _exit(EXIT_BROKEN, f"group broken: {reason}")

    def _refusal(self, hello: dict) -> str | None:
        rank = hello.get("rank")
        if hello.get("op") != "join" or not isinstance(rank, int):
            return "not a join message"
        if not 1 <= rank < self.nnodes:
            return f"rank {rank} is outside 1..{self.nnodes - 1}"
        if hello.get("nnodes") != self.nnodes:
            return f"worker says {hello.get('nnodes')} nodes, leader says {self.nnodes}"
        if hello.get("model") != self.args.model:
            return f"worker serves {hello.get('model')!r}, leader serves {self.args.model!r}"
        with self.lock:
            if rank in self.workers:
                return f"rank {rank} has already joined"
            if self.all_joined.is_set():
                return "the group has already formed"
        return None


# --- a worker ----------------------------------------------------------------------------


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def run(self) -> None:
        host, port = _split_addr(self.args.rendezvous)
        deadline = time.monotonic() + self.args.join_timeout
        logger.info("rank %d joining rendezvous %s:%d", self.args.rank, host, port)
        while True:
            try:
                # Connect only: a worker has no listening socket at all.
                sock = socket.create_connection((host, port), timeout=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    _exit(EXIT_TIMEOUT, f"no leader at {host}:{port} within {self.args.join_timeout:g}s")
                time.sleep(0.2)
        peer = Peer(sock, self.args.peer_timeout)
        peer.send(op="join", rank=self.args.rank, nnodes=self.args.nnodes, model=self.args.model,
                  fabric=self.args.fabric)
        peer.keep_pinging(lambda exc: _exit(EXIT_BROKEN, f"group broken: lost the leader ({exc})"))
        formed = False
        while True:
            try:
                message = peer.receive()
            except ConnectionError as exc:
                _exit(EXIT_BROKEN, f"group broken: the leader {exc}")
            op = message.get("op")
            if op == "refused":
                _exit(EXIT_REFUSED, f"the leader refused rank {self.args.rank}: {message.get('reason')}")
            elif op == "welcome":
                logger.info("joined: %s of %s worker(s) so far", message.get("joined"), self.args.nnodes - 1)
            elif op == "formed" and not formed:
                formed = True
                logger.info("group formed: %s member(s); rank %d serves nothing", message.get("nnodes"), self.args.rank)


def _forever() -> None:
    while True:
        signal.pause()  # the signal handlers and the peers' threads decide when this ends


def _split_addr(value: str) -> tuple[str, int]:
    host, sep, port = (value or "").rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"--rendezvous must be HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)


def _describe(fabrics: dict[int, str]) -> str:
    return ", ".join(f"rank {r}: {f or 'none'}" for r, f in sorted(fabrics.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw sim engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--rendezvous", default="", help="HOST:PORT the leader binds (required when --nnodes > 1)")
    parser.add_argument("--host", default="127.0.0.1", help="leader's HTTP address")
    parser.add_argument("--port", type=int, default=8000, help="leader's HTTP port")
    parser.add_argument("--model", required=True)
    parser.add_argument("--fabric", default="", help="this member's fabric ('' for none)")
    parser.add_argument("--join-timeout", type=float, default=600.0, help="give up forming the group after this")
    parser.add_argument("--peer-timeout", type=float, default=5.0, help="a peer silent this long is gone")
    model = parser.add_argument_group(
        "performance model", "an 8B model on one 80 GB GPU unless told otherwise (docs/agent.md#the-sim-engines-performance-model)")
    model.add_argument("--max-num-seqs", type=int, default=SimParams.max_num_seqs,
                       help="requests running at once; the others wait, first come first served")
    model.add_argument("--block-size", type=int, default=SimParams.block_size, help="tokens per KV-cache block")
    model.add_argument("--num-gpu-blocks-override", type=int, default=DEFAULT_NUM_GPU_BLOCKS,
                       help="KV-cache capacity in blocks")
    model.add_argument("--max-model-len", type=int, default=SimParams.max_model_len,
                       help="longest prompt + output, in tokens; longer requests get 400")
    model.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=SimParams.enable_prefix_caching, help="reuse cached prompt blocks")
    model.add_argument("--prefill-overhead", type=float, default=None,
                       help=f"seconds added to every time to first token (default {SimParams.prefill_overhead:g})")
    model.add_argument("--prefill-time-per-token", type=float, default=None,
                       help=f"seconds per uncached prompt token (default {SimParams.prefill_time_per_token:g})")
    model.add_argument("--decode-step-base", type=float, default=None,
                       help=f"seconds per decode step with one request running (default {SimParams.decode_step_base:g})")
    model.add_argument("--decode-step-per-seq", type=float, default=None,
                       help=f"seconds added to a decode step per running request (default {SimParams.decode_step_per_seq:g})")
    model.add_argument("--token-delay", type=float, default=None,
                       help="flat timing, as before the model: every decode step takes this long whatever the load, "
                            "and prefill takes no time (each unless set by its own flag)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nnodes < 1 or not 0 <= args.rank < args.nnodes:
        parser.error(f"--rank {args.rank} must be in 0..{args.nnodes - 1}")
    if args.nnodes > 1:
        _split_addr(args.rendezvous)
    args.params = params_from_args(args)
    problems = args.params.problems()
    if problems:
        parser.error("; ".join(problems))
    return args


def params_from_args(args: argparse.Namespace) -> SimParams:
    """The performance model's parameters. ``--token-delay`` (the flat timing
    of the engine before it had a model) sets the decode step and zeroes the
    load and prefill terms that are not set by their own flags."""
    flat = args.token_delay is not None

    def timing(value: float | None, default: float) -> float:
        return value if value is not None else (0.0 if flat else default)

    return SimParams(
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefill_overhead=timing(args.prefill_overhead, SimParams.prefill_overhead),
        prefill_time_per_token=timing(args.prefill_time_per_token, SimParams.prefill_time_per_token),
        decode_step_base=args.decode_step_base if args.decode_step_base is not None else (
            args.token_delay if flat else SimParams.decode_step_base),
        decode_step_per_seq=timing(args.decode_step_per_seq, SimParams.decode_step_per_seq),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s sim rank={args.rank} %(levelname)s %(message)s",
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: _exit(EXIT_STOPPED, f"stopped by {signal.Signals(s).name}"))
    (Leader(args) if args.rank == 0 else Worker(args)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
