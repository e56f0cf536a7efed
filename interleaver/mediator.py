"""The nnsight pieces nnrun specializes: a mediator and an interleaver that know the location.

nnsight's `Batcher.narrow/widen` receive a value and a group but not the location it came from,
and the base mediator never sees a read value again once it switched it into the worker. nnrun
needs both: the layout of a value (tokens, logit positions, request rows) is a property of its
location, and a several-request read is a gathered copy whose in-place edits must be written back.
So `PackedInterleaver.handle` records the location on the batcher for the duration of the visit,
and `PackedMediator.handle` scatters a gathered read back once the worker moves on, and throws a
wrong-shaped assignment into the worker, where the traceback names the user's line.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from greenlet import getcurrent

from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import EarlyStopException, Event, Interleaver, Mediator
from nnsight.util import apply

from interleaver.batcher import InvalidWriteError, PackedBatcher
from interleaver.block_interrupt import RunningBlocks
from interleaver.grads import sink_grads
from interleaver.skips import throw_unless_skipped
from interleaver.sources import CALLABLE_SUFFIX, forget_if_other_callable


class ServedValues:
    """Values an engine step produces outside any module, served like a module's output."""

    @eproperty(description="next-token logits of this request, this step")
    def logits(self, value: Any) -> Any:
        """`[1, V]` (a list invoke: `[k, V]`) logits the step samples from; assign to change them."""
        return value

    @eproperty(description="token ids sampled this step")
    def samples(self, value: Any) -> Any:
        """`[1]` (a list invoke: `[k]`) token ids sampled this step; assign to force tokens."""
        return value


class BlockInterrupt(Exception):
    """A `BaseException` a block raised (`KeyboardInterrupt`, `SystemExit`, `pytest.fail`, ...), carried
    as an ordinary error.

    Blocks run on the engine thread, where a `BaseException` would unwind the engine's own loop
    and strand every request in flight. Wrapped, it is deferred like any error of the block: it
    ends that block's requests only, and the trace re-raises `original` in the caller's thread.
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"the block raised {type(original).__name__}: {original}")
        self.original = original
        self.__intervention_tb__ = getattr(original, "__intervention_tb__", original.__traceback__)


def as_block_error(error: BaseException) -> Exception:
    """`error` as an `Exception` the engine can defer (a `BaseException` is wrapped)."""
    return error if isinstance(error, Exception) else BlockInterrupt(error)


def original_error(error: BaseException) -> BaseException:
    """What the user's block raised, unwrapped."""
    return error.original if isinstance(error, BlockInterrupt) else error


class PackedMediator(Mediator):
    """A mediator whose reads may be gathered copies and whose writes are shape-checked.

    `edited_at` is the last location this block changed in the current step (an assignment, a
    skip, or an in-place edit of a value it was served): if the step fails, the blocks that
    edited it are the ones to blame (see `NNsightGPUModelRunner.requests_to_blame`).
    """

    edited_at: str | None = None

    def is_waiting_for(self, provider: str) -> bool:
        """Whether the block is parked on `provider` (otherwise a visit of it hands the value straight back)."""
        pending = self.pending
        return pending is not None and pending.provider == provider

    def handle(self, provider: str, value: Any) -> Any:
        """Serve this worker's events parked on this visit (the protocol of `Mediator.handle`)."""
        pending = self.pending
        if pending is None or pending.provider != provider:  # (`is_waiting_for`, inlined: once per read)
            return value
        interleaver = self.interleaver
        occurrence = interleaver.counts.get(provider, 0) - self.counts_at_start.get(provider, 0)  # (`occurrence`)
        batcher: PackedBatcher = interleaver.batcher
        group = self.batch_group
        while pending is not None and pending.provider == provider and pending.iteration == occurrence:
            if self.iteration:  # the first hit of a pinned step relaxes the pin, as in nnsight
                self.iteration = None
            event = pending.event
            if event is Event.VALUE:
                try:
                    served = batcher.narrow(value, group)
                except InvalidWriteError as error:  # a read the step cannot serve this request alone
                    self.pending = self.throw(error)
                    pending = self.pending
                    continue
                if torch.is_grad_enabled():  # a step that runs with autograd: `.retain_grad()` must work
                    sink_grads(value, served)
                versions = _versions(served)
                try:
                    self.pending = self.switch(served)
                finally:
                    if _versions(served) != versions:  # an in-place edit bumps the version counter
                        self.edited_at = provider
                if served is not value and not group.is_single:
                    batcher.scatter_back(value, group, served)
            elif event is Event.SWAP:
                try:
                    value = batcher.widen(value, group, pending.value)
                except InvalidWriteError as error:
                    self.pending = throw_unless_skipped(self, provider, error)
                else:
                    self.edited_at = provider
                    self.pending = self.switch()
            elif event is Event.SKIP:
                try:
                    value = batcher.gather_skip(value, group, pending.value)
                except InvalidWriteError as error:
                    self.pending = self.throw(error)
                else:
                    self.edited_at = provider
                    self.pending = self.switch()
            else:
                break
            pending = self.pending
        return value

    def switch(self, *args: Any) -> Any:
        """Resume the worker (nnsight's `Mediator.switch`) as the engine thread's interruptible running block;
        return its next park. Whatever it raises reaches the engine as an `Exception`."""
        worker, current = self.worker, getcurrent()
        if worker.parent is not current:  # parks and finishes return here, as in nnsight (setting it costs a check)
            worker.parent = current
        return self._run_block(worker.switch, *args)

    def throw(self, error: BaseException) -> Any:
        """Raise `error` inside the worker at the line it is parked on; return its next park."""
        self.worker.parent = getcurrent()
        return self._run_block(self.worker.throw, error)

    def _run_block(self, resume: Any, *args: Any) -> Any:
        """Run the block until it parks, as the engine thread's interruptible running block."""
        blocks = self.interleaver.running_blocks
        blocks.enter(self)
        try:
            try:
                return resume(*args)
            except BaseException as raised:
                if not hasattr(raised, "__intervention_tb__"):  # the block's frames only, as nnsight keeps them
                    raised.__intervention_tb__ = raised.__traceback__
                raise
            finally:
                blocks.leave(self)
        except Exception:
            raise
        except BaseException as raised:
            blocks.leave(self)  # an interrupt may have landed in the first leave(), before it took the lock
            raise BlockInterrupt(raised) from None


def _versions(value: Any) -> int | list[int]:
    """The version counters of the tensors in a served value (views share their base's counter)."""
    if type(value) is torch.Tensor:  # the common case (a module's hidden states): no tree walk
        return value._version
    found: list[int] = []
    apply(value, lambda tensor: found.append(tensor._version), torch.Tensor)
    return found


class PackedInterleaver(Interleaver):
    """An interleaver that tells its batcher which location each visit is, and finds the workers parked on a
    visit by location (`parked`), so a visit costs the workers waiting on it, not every worker in the step."""

    def __init__(self, batcher: PackedBatcher, fragments: Any = None) -> None:
        super().__init__(fragments)
        self.batcher = batcher
        self.defer_exceptions = True  # one request's error ends that request, not the step
        self.running_blocks = RunningBlocks()

    def __enter__(self) -> "PackedInterleaver":
        # nnsight forgets drilled callables (`op.source`) per run; an engine run is one step of
        # many, while on HF one run spans the whole generation, so a block that drilled in (or is
        # parked waiting to) keeps the entry across steps. The request helper clears them when idle.
        kept = dict(self.sourced)
        super().__enter__()
        self.sourced.update(kept)
        return self

    @contextmanager
    def resumed(self) -> Iterator["PackedInterleaver"]:
        """Interleave again later in a step, for the workers `mediators` holds, indexed as they are now.

        What `with interleaver:` does minus its setup (starting workers, `reindex`): the runner enters
        this several times a step (logits, samples, the streamer), each time just after `reindex`.
        An early stop ends the visit it fired at, as `__exit__` has it.
        """
        self.interleaving = True
        try:
            yield self
        except EarlyStopException:
            pass
        finally:
            self.interleaving = False

    def _reindex_parked(self) -> None:
        """`parked`: location -> the workers parked on it, in serving order (nnsight keeps only the locations).

        A visit then looks only at the workers waiting on it, not at every worker in the step.
        """
        parked: dict[str, list[Mediator]] = {}
        for mediator in self.mediators:
            pending = mediator.pending
            if pending is not None and pending.provider is not None:
                waiting = parked.get(pending.provider)
                if waiting is None:
                    parked[pending.provider] = [mediator]
                else:
                    waiting.append(mediator)
        self.parked = parked

    def _ready(self, provider: str) -> list[Mediator]:
        """The workers parked on this visit of `provider` (as nnsight's, from the index of `parked`)."""
        waiting = self.parked.get(provider)
        if not waiting:
            return []
        count = self.counts.get(provider, 0)
        return [
            mediator
            for mediator in waiting
            if (pending := mediator.pending) is not None
            and pending.provider == provider
            and pending.iteration == count - mediator.counts_at_start.get(provider, 0)
        ]

    def handle(self, provider: str, value: Any) -> Any:
        batcher = self.batcher
        if (
            provider not in self.parked
            and not self.sourced
            and not batcher.pending_skips
            and provider not in self.observers
        ):
            # Most visits of a step serve nobody (every module hands over its input, skip gate and
            # output): count them as the base interleaver does, without recording the location.
            self.counts[provider] = self.counts.get(provider, 0) + 1
            return value
        if self.sourced and provider.endswith(CALLABLE_SUFFIX):
            forget_if_other_callable(self.sourced, provider[: -len(CALLABLE_SUFFIX)], value)
        previous, batcher.location = batcher.location, provider
        try:
            if batcher.pending_skips:
                value = batcher.splice_skips(provider, value)
            return self._serve(provider, value)
        finally:
            batcher.location = previous
            batcher.forget_views()

    def _serve(self, provider: str, value: Any) -> Any:
        """nnsight's `Interleaver.handle` past its fast path, serving only the workers parked on `provider`.

        The protocol is nnsight's: every worker parked on this visit is served in turn, the index is
        rebuilt after a pass that served any (a served worker may have released others from a
        barrier onto this very visit, and they are served in it too), the visit is counted once at
        the end, an early stop is raised after the visit, other errors are deferred to their worker.
        """
        counts = self.counts
        occurrence = counts.get(provider, 0)
        observers = self.observers.get(provider, ())
        undo = None
        fragments = self.fragments
        if (
            fragments is not None
            and fragments.enabled
            and fragments.fragmented(provider)
            and (observers or self._ready(provider))
        ):
            value, undo = fragments.whole(provider, value)
        stopped = None
        while ready := self._ready(provider):
            for mediator in ready:
                try:
                    value = mediator.handle(provider, value)
                except Exception as exception:
                    if self.defer_exceptions:
                        mediator.exception = exception
                    elif isinstance(exception, EarlyStopException):
                        stopped = exception
                    else:
                        raise
                    mediator.pending = None
            self._reindex_parked()
        counts[provider] = occurrence + 1
        value = self.batcher.assemble_skip(value)
        for mediator, cache, selected in observers:
            cache.observe_selected(selected, self.batcher.narrow(value, mediator.batch_group))
        if undo is not None:
            value = undo(value)
        if stopped is not None:
            raise stopped
        return value
