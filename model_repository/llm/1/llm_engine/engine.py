"""The generation engine: a background thread that schedules, runs and streams every step.

``submit()`` is thread-safe and returns at once; results go to each request's
``emit`` callback (a :class:`StepOutput`, or an :class:`EngineError` that ends the
request). ``step()`` is four moves: drop cancelled work, schedule, run the model
and sample, then post-process and emit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from . import contract
from .admission import EngineLimits, admit
from .batch import build_step_input
from .beam_steps import BeamSteps
from .cpu_cores import CoreSplit, pin_current_thread
from .detokenizer import IncrementalDetokenizer
from .device import use_in_this_thread
from .errors import EngineError, Overloaded, RequestTimeout
from .kv_cache import BlockManager
from .outputs import TokenTexts, logprob_entry, step_output, step_outputs
from .runner import ModelRunner, StepInput
from .sampler import RowSpec, sample
from .scheduler import Plan, Scheduler
from .sequence import Request, Sequence, Status
from .stopping import StopChecker
from .structured import GrammarMatchers, accept, constrain

log = logging.getLogger(__name__)
SLOW_STEP_SECONDS = 1.0  # a step slower than this is logged with what it ran


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, blocks: BlockManager, scheduler: Scheduler,
                 limits: EngineLimits, eos_token_ids: list[int], metrics=None, cores: CoreSplit | None = None,
                 step_timeout: float = 0.0, max_failed_steps: int = 0):
        self.runner = runner
        self.tokenizer = tokenizer
        self.blocks = blocks
        self.scheduler = scheduler
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.cores = cores  # when set, the engine thread runs on cores.engine (see cpu_cores)
        self._inbox: deque[Request] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = self.last_batch_size = 0
        self.dropped: list[str] = []  # ids of requests ended by cancellation (bounded)
        self._beams = BeamSteps(self)
        self.step_timeout = step_timeout  # see health()
        self.max_failed_steps = max_failed_steps
        self._step_started = 0.0  # time.monotonic() of the step running now, 0 between steps
        ops = getattr(runner, "ops", None)  # the fused CPU kernels, when the runner has them
        self._row_stats = ops.argmax_logsumexp if ops is not None else None
        self.failed_steps_in_a_row = 0
        self.token_text = TokenTexts(tokenizer)  # one token's text, as logprobs report it
        self.grammars = GrammarMatchers(tokenizer, getattr(runner, "vocab_size", 0) or limits.vocab_size, eos_token_ids)

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self.grammars.warm_up, name="grammar-warm-up", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request still open ends with an error. That is done by the
        engine thread as it leaves, so that no other thread changes the scheduler during a
        step; here only when the thread is gone (or never ran)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout)
        if self.alive:
            log.warning("the engine thread is still in a step after %.0f s; it ends the open requests "
                        "when that step does", timeout)
            return
        self._fail_open_requests()

    def _fail_open_requests(self) -> None:
        with self._wake:
            open_requests = list(self.scheduler.requests()) + list(self._inbox)
            self._inbox.clear()
        for req in open_requests:
            self._fail(req, EngineError("the model is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> str:
        """Why the engine cannot serve any more ("" while it can): its thread ended, a step
        has run for longer than ``step_timeout``, or ``max_failed_steps`` steps failed in a
        row. Nothing in-process recovers from these; the caller should restart it."""
        if self._thread is not None and not self.alive and not self._stop:
            return "the engine thread has ended"
        started = self._step_started
        if self.step_timeout and started and time.monotonic() - started > self.step_timeout:
            return f"an engine step has run for more than {self.step_timeout:g} s"
        if self.max_failed_steps and self.failed_steps_in_a_row >= self.max_failed_steps:
            return f"{self.failed_steps_in_a_row} engine steps failed in a row"
        return ""

    # -- submission -------------------------------------------------------------
    def prepare(self, req: Request) -> None:
        """Check lengths and fill in the derived limits; raises :class:`EngineError`."""
        admit(req, self.limits)
        req.sequences = [self._new_sequence(req, 0, list(req.prompt_ids))]

    def submit(self, req: Request) -> None:
        """Queue a request (after :meth:`prepare`). Thread-safe, never blocks on generation."""
        if self.scheduler.num_waiting + len(self._inbox) >= self.scheduler.max_waiting:
            raise Overloaded(f"the engine queue is full ({self.scheduler.max_waiting} waiting requests)")
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()

    def _new_sequence(self, req: Request, index: int, tokens: list[int], parent: Sequence | None = None) -> Sequence:
        """Sequence ``index`` of ``req``; a fork of ``parent`` copies its grammar state."""
        p = req.params
        matcher = self.grammars.matcher(req.grammar, parent.matcher if parent is not None else None)
        gen = None
        if not p.greedy or p.use_beam_search:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed((req.seed + index * 0x9E3779B97F4A7C15) % 2**64)
        return Sequence(
            request=req, index=index, token_ids=tokens,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens),
            stopper=StopChecker(p.stop, p.stop_token_ids, self.eos_token_ids, p.ignore_eos,
                                p.include_stop_str_in_output),
            generator=None if p.greedy else gen, matcher=matcher,
        )

    # -- the loop -----------------------------------------------------------------
    def _loop(self) -> None:
        log.info("engine loop started")
        use_in_this_thread(self.runner.device)
        if self.cores:
            pin_current_thread(self.cores.engine, "the engine thread")
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.scheduler.requests():
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    break
                new = list(self._inbox)
                self._inbox.clear()
            for req in new:
                try:
                    self.scheduler.add(req)
                except EngineError as exc:
                    self._fail(req, exc)
            try:
                self.step()
            except Exception:  # a bug must not kill the loop; fail what ran and go on
                log.exception("engine step failed")
        self._fail_open_requests()

    @torch.inference_mode()
    def step(self) -> None:
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        if not plan.items:
            self.last_batch_size = 0
            if self.metrics:
                self.metrics.on_state(self)
            time.sleep(0.001)
            return
        now = time.monotonic()
        for it in plan.items:
            it.seq.request.note_scheduled(now)
        self._step_started = now
        try:
            self._run_step(plan, now)
        finally:
            self._step_started = 0.0

    def _run_step(self, plan: Plan, now: float) -> None:
        advanced = False
        try:
            self.runner.copy_blocks(plan.copies)
            step_in, owners = self._build_input(plan)
            logits = self.runner.forward(step_in)
            for it in plan.items:
                it.seq.num_computed += it.num_tokens
            advanced = True
            owners, rows_idx = self._expand_forks(owners)
            sampled = owners  # every row that gets a token this step, beams included
            if len(rows_idx) != logits.shape[0]:
                logits = logits[torch.tensor(rows_idx, device=logits.device)]
            constrain(logits, owners)
            beam_rows = [i for i, s in enumerate(owners) if s.request.params.use_beam_search]
            if beam_rows:
                keep = [i for i, s in enumerate(owners) if not s.request.params.use_beam_search]
                beam_seqs = [owners[i] for i in beam_rows]
                beam_lp = torch.log_softmax(logits[beam_rows], dim=-1)
                owners = [owners[i] for i in keep]
                logits = logits[keep]
            result = sample(logits, [self._row_spec(seq) for seq in owners], self._row_stats)
        except Exception as exc:
            self.failed_steps_in_a_row += 1
            self._step_failed(plan, exc, advanced)
            return
        self.failed_steps_in_a_row = 0
        self.steps += 1
        self.last_batch_size = plan.num_sequences
        t_forward = time.monotonic()
        self._postprocess(plan, owners, result, sampled)
        if beam_rows:
            self._beams.advance(beam_seqs, beam_lp)
        if self.metrics:
            self.metrics.on_step(self)
        done = time.monotonic()
        if done - now > SLOW_STEP_SECONDS:
            prefill = [it.num_tokens for it in plan.items if it.num_tokens > 1]
            log.warning("slow engine step: %.2fs (forward+sample %.2fs) for %d sequences, %d prefill chunks "
                        "of %d tokens", done - now, t_forward - now, plan.num_sequences, len(prefill), sum(prefill))

    def _step_failed(self, plan: Plan, exc: Exception, advanced: bool) -> None:
        """Fail the requests most likely to have caused a failed step; the others retry it.

        Requests that were prefilling in this step (new input) are blamed; when there
        are none, every request in the step is. The rest roll back and run again.
        """
        if advanced:
            for it in plan.items:
                it.seq.num_computed -= it.num_tokens
        reqs = {id(it.seq.request): it.seq.request for it in plan.items}
        blamed = {id(it.seq.request) for it in plan.items if it.num_tokens > 1 or it.seq.num_generated == 0}
        blamed = blamed or set(reqs)
        log.error("engine step failed (%s: %s); failing %d of %d requests, the others retry",
                  type(exc).__name__, exc, len(blamed), len(reqs), exc_info=exc)
        for key in blamed:
            self._fail(reqs[key], EngineError(f"generation failed: {exc}"))

    # -- helpers -------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for req in self.scheduler.requests():
            try:
                cancelled = req.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                log.info("request %s cancelled by its client; dropping it", req.request_id)
                self.dropped.append(req.request_id)
                del self.dropped[:-1000]
                self._finish_request(req, contract.FINISH_CANCELLED)
            elif req.deadline is not None and now > req.deadline:
                self._fail(req, RequestTimeout("Engine callback timeout: client timeout"))

    def _build_input(self, plan: Plan) -> tuple[StepInput, list[Sequence]]:
        return build_step_input(plan, self.blocks.block_size, self.runner.device, self.runner.dummy_slot)

    def _row_spec(self, seq: Sequence) -> RowSpec:
        p = seq.request.params
        return RowSpec(
            temperature=max(p.temperature, 1e-6), top_k=p.top_k or 0, top_p=p.top_p,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, generator=seq.generator,
            logprobs=p.logprobs if p.logprobs else None,
            prompt_ids=seq.request.prompt_ids, output_ids=seq.output_ids,
        )

    def _postprocess(self, plan: Plan, owners: list[Sequence], result, sampled: list[Sequence]) -> None:
        now = time.monotonic()
        stepped = {id(it.seq.request): it.seq.request for it in plan.items}
        for req in {id(seq.request): seq.request for seq in sampled}.values():
            req.record_token_step(plan.num_requests, now)
        for row, seq in enumerate(owners):
            if seq.request.done:
                continue
            try:
                self.blocks.register_prompt_blocks(seq.table, seq.token_ids,
                                                   min(seq.num_computed, seq.request.prompt_len))
                self._append(seq, result.tokens[row], result.logprobs[row], result.top[row])
            except Exception as exc:  # a bug in one request's post-processing ends only that request
                log.exception("post-processing request %s failed", seq.request.request_id)
                self._fail(seq.request, EngineError(f"generation failed: {exc}"))
        first, running = [], []
        for req in stepped.values():
            if req.done or req.params.use_beam_search:
                continue
            (first if req.sequences[0].num_generated <= 1 else running).append(req)
        # A first token goes out ahead of the running requests' next ones: the model's sender
        # thread sends in this order, each send a round trip to tritonserver (0.3-0.7 ms), and
        # a newcomer among 7 decodes waited 4.75 ms (median) for the others' sends.
        for req in first + running:
            self._emit(req)

    def _expand_forks(self, owners: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Start the other best_of/n sequences once the prompt is computed; they share its logits."""
        expanded: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(owners):
            expanded.append(seq)
            rows.append(row)
            req = seq.request
            if (seq.index == 0 and seq.num_generated == 0 and len(req.sequences) < req.params.num_sequences
                    and not req.params.use_beam_search):
                for i in range(len(req.sequences), req.params.num_sequences):
                    child = self._new_sequence(req, i, list(seq.token_ids), parent=seq)
                    child.table = self.blocks.fork(seq.table)
                    child.num_computed = seq.num_computed
                    child.status = Status.RUNNING
                    req.sequences.append(child)
                    expanded.append(child)
                    rows.append(row)
        return expanded, rows

    def _append(self, seq: Sequence, token: int, logprob: float, top) -> None:
        req = seq.request
        if not seq.first_token_time:
            seq.first_token_time = time.monotonic()
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        seq.pending_ids.append(token)
        if seq.stopper.is_stop_token(token):
            seq.pending_lens.append(0)
            text = self._held_back_text(seq)
            self._finish(seq, contract.FINISH_STOP)
        else:
            new = seq.detok.step(token)
            seq.pending_lens.append(len(new))
            text, matched = seq.stopper.feed(new)
            complete = seq.matcher is not None and accept(seq, token)  # the JSON is whole
            if matched:
                self._finish(seq, contract.FINISH_STOP)
            elif complete or seq.num_generated >= req.max_new_tokens:
                text += self._held_back_text(seq)
                self._finish(seq, contract.FINISH_STOP if complete else contract.FINISH_LENGTH)
        seq.pending_text += text
        if req.params.logprobs is not None:
            seq.pending_logprobs.append(logprob_entry(self.token_text, token, logprob, top,
                                                      req.params.skip_special_tokens))

    @staticmethod
    def _held_back_text(seq: Sequence) -> str:
        """At a sequence's end: the text held back as a possible stop-string start or an
        unfinished character, which no later token can complete now."""
        return seq.stopper.feed(seq.detok.flush())[0] + seq.stopper.flush()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.scheduler.release_sequence(seq)

    def _emit(self, req: Request) -> None:
        """Send what each sequence produced this step (stream) or at its end (non-stream)."""
        all_done = all(s.finished for s in req.sequences)
        outputs = []
        for seq in req.sequences:
            if seq.reported:
                continue
            finishing = seq.finished
            if not req.stream and not finishing:
                continue
            if not finishing and (not seq.pending_ids or (req.stream and seq.stopper.holding)):
                continue  # nothing new, or a stop string may be starting: those steps go out once it is not
            outputs.extend(step_outputs(seq, finishing) if req.stream else [step_output(seq, finishing)])
        if all_done:
            self.scheduler.remove(req)
            req.done = True
            if not outputs:
                outputs.append(step_output(req.sequences[0], True, empty=True))
            outputs[-1].final = True
        for out in outputs:
            req.emit(out)

    def _finish_request(self, req: Request, reason: str) -> None:
        if req.params.use_beam_search:
            self._beams.finish(req, reason)
            return
        for seq in req.sequences:
            if not seq.finished:
                seq.status = Status.FINISHED
                seq.finish_reason = reason
        self._emit(req)
        self.scheduler.remove(req)
        req.done = True

    def _fail(self, req: Request, exc: EngineError) -> None:
        if req.done:
            return
        self.scheduler.remove(req)
        req.done = True
        for seq in req.sequences:
            seq.status = Status.FINISHED
        try:
            req.emit(exc)
        except Exception:
            log.exception("could not report an error to request %s", req.request_id)
