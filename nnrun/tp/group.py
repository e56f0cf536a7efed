"""RankGroup: the front end's handle on its N rank processes: start, send a step, wait for logits, stop.

Waiting is always bounded and always watches every rank: a rank that dies (its process
sentinel fires), reports an error (its pipe becomes readable) or stays silent past the step
timeout ends the whole group, and every later step raises the same `TensorParallelError`.
The rendezvous store belongs to the front end, so no port outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nnrun.tp.wire as wire
from nnrun.config import EngineConfig
from nnrun.tp.main_guard import check_main_guard
from nnrun.tp.worker import DEFAULT_RANK_RUNNER, RankSpec, run_rank

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0  # loading a shard of a large checkpoint from a slow disk
STOP_GRACE_S = 5.0  # a rank told to stop has this long before it is killed
DEATH_GRACE_S = 0.5  # after an error, how long to look for the rank whose death caused it
# A pipe (a socket pair) buffers at least this much, so a smaller send never blocks, even on a
# rank that has stopped reading: only one step is ever in flight.
INLINE_SEND_BYTES = 64 << 10


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a rank died, hung or raised); the engine cannot run steps any more."""


class RankGroup:
    """N rank processes on this machine, spawned and joined over torch.distributed."""

    def __init__(self, config: EngineConfig, checkpoint: str, rank_runner: str = DEFAULT_RANK_RUNNER) -> None:
        check_main_guard()  # before any rank starts: a rank would re-run an unguarded script's top level
        parallel = config.parallel
        self.world_size = parallel.tensor_parallel_size
        self.step_timeout_s = parallel.tensor_parallel_timeout
        self._error: TensorParallelError | None = None
        self.failure: TensorParallelError | None = None  # why the group failed (a rank died, hung or raised)
        self._lock = threading.RLock()  # stop() may come from another thread than the steps
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.step_timeout_s)
        )
        worker_config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer=None))
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        context = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes: list = []
        # Registered before the first start: ranks already started are stopped even if a later one fails to.
        self._finalizer = weakref.finalize(self, _stop_processes, self.conns, self.processes)
        for rank in range(self.world_size):
            ours, theirs = context.Pipe(duplex=True)
            spec = RankSpec(
                rank,
                self.world_size,
                self._store.port,
                checkpoint,
                worker_config,
                self.step_timeout_s,
                num_threads,
                rank_runner,
            )
            process = context.Process(
                target=run_rank, args=(spec, theirs, os.getpid()), daemon=True, name=f"nnrun-tp-rank{rank}"
            )
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)

    # ---- start -------------------------------------------------------------------------------
    def wait_ready(self) -> dict:
        """Block until every rank has loaded its shard; returns rank 0's report (layers, pages, context)."""
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while len(reports) < self.world_size:
            pending = [rank for rank in range(self.world_size) if rank not in reports]
            self._wait_any(pending, deadline, "loading its shard")
            for rank in pending:
                if self.conns[rank].poll():
                    reports[rank] = self._receive_report(rank)
        return reports[0]

    def _receive_report(self, rank: int) -> dict:
        message = self._recv(rank, "loading its shard")
        if wire.message_kind(message) is wire.MessageKind.ERROR:
            self._fail_with_report(message, "loading its shard")
        return wire.decode_report(message)

    # ---- steps -------------------------------------------------------------------------------
    def run_step(self, message: memoryview) -> torch.Tensor:
        """Send one step to every rank; returns rank 0's answer on the CPU: logits `[R, V]` or token ids `[R]`."""
        self._send_all(message)
        header = self._answer_of_rank0("running a step")
        return wire.decode_tensor(header, bytearray(self._recv(0, "sending its answer")))

    def exchange(self, payload: bytes) -> bytes:
        """Send a runner's own message to every rank; returns rank 0's answer (`ShardRunner.serve_exchange`)."""
        self._send_all(wire.encode_exchange(wire.MessageKind.EXCHANGE, payload))
        return wire.exchange_payload(self._answer_of_rank0("answering an exchange"))

    def _answer_of_rank0(self, doing: str) -> bytes:
        """Rank 0's next message, within the step timeout; any rank's error (or death) ends the group first."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            self._wait_any(list(range(self.world_size)), deadline, doing)
            for rank in range(1, self.world_size):  # only rank 0 answers; another rank speaks only to report an error
                if self.conns[rank].poll():
                    self._fail_with_report(self._recv(rank, doing), doing)
            if self.conns[0].poll():
                message = self._recv(0, doing)
                if wire.message_kind(message) is wire.MessageKind.ERROR:
                    self._fail_with_report(message, doing)
                return message

    def start_profile(self) -> None:
        """Start timing the ranks' collectives (between steps: the caller holds the runner's step lock)."""
        self._send_all(wire.encode_kind(wire.MessageKind.PROFILE_START))

    def stop_profile(self) -> dict[str, float]:
        """Stop timing; rank 0's `wall_s`, `collective_s` and `num_collectives` since `start_profile`."""
        self._send_all(wire.encode_kind(wire.MessageKind.PROFILE_STOP))
        self._wait_any([0], time.monotonic() + self.step_timeout_s, "reporting its collective times")
        message = self._recv(0, "reporting its collective times")
        if wire.message_kind(message) is wire.MessageKind.ERROR:
            self._fail_with_report(message, "reporting its collective times")
        return wire.decode_report(message)

    def _send_all(self, message: bytes | memoryview) -> None:
        """Send to every rank. A message larger than a socket buffer is sent from a thread the front end
        waits for with the step timeout: a hung rank stops reading, and a blocked send must not hang us."""
        self.check_alive()
        failure: list[BaseException] = []

        def send() -> None:
            try:
                for conn in self.conns:
                    conn.send_bytes(message)
            # TypeError and ValueError too: a hung rank failed the group, which closed the pipe under this send
            except (OSError, TypeError, ValueError) as error:
                failure.append(error)

        if memoryview(message).nbytes <= INLINE_SEND_BYTES:
            send()
        else:
            sender = threading.Thread(target=send, name="nnrun-tp-send", daemon=True)
            sender.start()
            sender.join(self.step_timeout_s)
            if sender.is_alive():
                self._fail(
                    TensorParallelError(
                        f"a tensor-parallel rank read no step for {self.step_timeout_s:g} s (tensor_parallel_timeout); "
                        f"it is hung. All {self.world_size} ranks were stopped"
                    )
                )
        if failure:
            # A closed pipe is a rank that died; under load its exit status lags the pipe's close: wait for it a
            # little, as `_fail_with_report` does, so that the error names the rank and how it died
            self._fail(
                self._first_death("receiving a message", grace_s=DEATH_GRACE_S)
                or TensorParallelError(
                    f"a tensor-parallel rank closed its pipe before a message was sent ({failure[0]})"
                )
            )

    def _recv(self, rank: int, doing: str) -> bytes:
        try:
            return self.conns[rank].recv_bytes()
        except (EOFError, OSError):
            self._fail(self._death_error(rank, doing))

    def _wait_any(self, ranks: list[int], deadline: float, doing: str) -> None:
        """Until one of `ranks` has something to read; a dead rank or the deadline ends the group."""
        sentinels = {self.processes[rank].sentinel: rank for rank in range(self.world_size)}
        remaining = deadline - time.monotonic()
        ready = wait([self.conns[rank] for rank in ranks] + list(sentinels), max(0.0, remaining))
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead and not any(self.conns[rank].poll() for rank in ranks):
            self._fail(self._death_error(dead[0], doing))
        if not ready:
            self._fail(
                TensorParallelError(
                    f"the tensor-parallel group gave no answer within {self.step_timeout_s:g} s while {doing} "
                    f"(tensor_parallel_timeout); a rank is hung. All {self.world_size} ranks were stopped"
                )
            )

    # ---- faults ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self._error is not None:
            raise TensorParallelError(f"the tensor-parallel group has stopped: {self._error}") from self._error

    def _fail_with_report(self, message: bytes, doing: str) -> None:
        rank, text = wire.decode_error(message)
        died = self._first_death(doing, grace_s=DEATH_GRACE_S)  # a dead peer is the root cause, not its echo
        if died is not None:
            self._fail(died)
        self._fail(TensorParallelError(f"tensor-parallel rank {rank} failed while {doing}:\n{text.rstrip()}"))

    def _first_death(self, doing: str, grace_s: float = 0.0) -> TensorParallelError | None:
        """A rank killed by a signal (not one that reported and left), looked for up to `grace_s`."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.processes):
                if process.exitcode is not None and process.exitcode < 0:
                    return self._death_error(rank, doing)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _death_error(self, rank: int, doing: str) -> TensorParallelError:
        process = self.processes[rank]
        process.join(DEATH_GRACE_S)
        code = process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return TensorParallelError(
            f"tensor-parallel rank {rank} (pid {process.pid}) {how} while {doing}; "
            f"all {self.world_size} ranks were stopped"
        )

    def _fail(self, error: TensorParallelError) -> None:
        """Stop every rank at once and remember why: this and every later step raise `error`."""
        with self._lock:
            if self._error is None:
                self._error = error
                self.failure = error
            for process in self.processes:  # the survivors may sit in a collective that waits for the dead
                if process.is_alive():
                    process.kill()
        self.stop()
        raise self._error

    # ---- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell every rank to stop, kill the ones that do not, and close the rendezvous port (idempotent)."""
        with self._lock:
            self._finalizer()
            self._store = None
            if self._error is None:
                self._error = TensorParallelError("the engine was shut down")


def _stop_processes(conns: list[Connection], processes: list) -> None:
    for conn in conns:
        try:
            conn.send_bytes(wire.encode_kind(wire.MessageKind.STOP))
        except OSError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()  # SIGKILL also ends a stopped (SIGSTOP) or hung rank
            process.join(STOP_GRACE_S)
    for conn in conns:
        conn.close()
