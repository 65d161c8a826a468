"""The llm stage: a queue worker taking turns from `sv:work:llm`, and the gRPC service (Reply,
EndOfTurn, Prepare, Capabilities). Either way a reply is written step by step to the turn's token log
(`sv:turn:{id}:tokens`), and a turn another worker left half done is resumed from that log.

A reply keeps its session's KV cache for the next one (`llm.prefix_cache_sessions`), and a
turn with a budget that runs late is planned down before it prefills (pipeline/llm/budget.py);
what it gave up is listed in the last step's `times.degradations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from pipeline.llm.batch import BatchedDecoder, BatchScheduler
from pipeline.llm.budget import BudgetOptions, BudgetPolicy, Plan, PromptChoice, TurnBudget
from pipeline.llm.caption_cleaner import caption_request
from pipeline.llm.end_of_turn import EndOfTurnScorer
from pipeline.llm.engine import TRANSCRIPT, DecodeStep, GenerationRequest, Generator
from pipeline.llm.model import LoadedModel, load_model
from pipeline.llm.options import SamplingOptions
from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, fit_history
from pipeline.models import resolve_llm
from services.protos import load, load_common
from services.server import logs, metrics, tracing
from services.server.errors import status_on_error, work_through_log
from services.server.model_worker import ModelWorker
from services.server.runtime import Service, service_main
from services.server.stage_clock import StageClock
from services.settings import Settings
from services.store.client import REDIS_ERRORS, now_ms
from services.store.context import RedisContext, open_redis
from services.store.keys import token_stream_key, turn_key
from services.store.sessions import SessionStore
from services.store.turn_log import (
    LogGap,
    LogMoved,
    TokenEntry,
    TokenStreamWriter,
    TurnLogWriter,
    TurnStore,
    read_token_log,
)
from services.store.work_queue import WorkItem, WorkQueue, run_worker, work_request

log = logging.getLogger(__name__)
pb, pb_grpc = load("llm")
common = load_common()
TASKS = {pb.ReplyRequest.CAPTION: Task.CAPTION}
FINISHED = ("eos", "length", "stop")  # a reply that ended so was written whole
SCORE_WAIT_S = 1.0  # a reply waits this long at most for its session's end-of-turn score in progress
PREPARE_YIELD_S = 1.0  # a Prepare of the user's words goes after work due up to this much later


class LlmServicer(pb_grpc.LlmServicer):
    def __init__(self, settings: Settings, loaded: LoadedModel, redis: RedisContext) -> None:
        self.settings = settings
        self.loaded = loaded
        self.generator = Generator.from_options(loaded, settings.llm)
        self.redis = redis
        self.sessions: SessionStore = redis.sessions
        self.turns: TurnStore = redis.turns
        self.worker = ModelWorker("llm")
        self._pending: set[asyncio.Task] = set()
        # Other than 1, concurrent replies share each verification pass (BatchedDecoder checks the size).
        o = settings.llm
        batch = o.max_batch_size
        decoder = BatchedDecoder(self.generator, batch, urgent_tokens=o.urgent_tokens,
                                 park_min_tokens=o.park_min_tokens)
        self.scheduler = BatchScheduler(decoder, self.worker.call) if batch != 1 else None
        # With a prefix cache the end-of-turn score runs on the session's conversation as the reply
        # will see it (all the history that fits), so that the reply reuses what the score prefilled.
        self._scored_cache = self.generator.prefix_cache if self.generator.prefix_cache.sessions else None
        # Built at the first EndOfTurn: a model that is not ChatML still serves Reply, and only
        # EndOfTurn says why it cannot score.
        self._end_of_turn: EndOfTurnScorer | None = None
        self._scoring: dict[str, asyncio.Event] = {}  # session -> its end-of-turn score in progress, set when done
        self.policy = BudgetPolicy(BudgetOptions(degraded_max_new_tokens=settings.llm.degraded_max_new_tokens,
                                                 degraded_max_draft_tokens=settings.llm.degraded_max_draft_tokens))

    def _steps(self, generation: GenerationRequest, should_stop) -> AsyncIterator[DecodeStep]:
        if self.scheduler is not None:
            return self.scheduler.steps(generation, should_stop)
        return self.worker.iterate(self.generator.steps(generation, should_stop))

    async def Capabilities(self, request, context: grpc.aio.ServicerContext):
        """What a caller may ask for: the drafters, the defaults, the context and the model as it runs."""
        options = self.settings.llm
        ref = resolve_llm(options.model)
        return pb.ServiceCapabilities(drafters=list(self.generator.drafters), default_drafter=options.drafter,
                                      max_new_tokens=options.max_new_tokens, context_tokens=self.loaded.context_tokens,
                                      model=ref.gguf_file or ref.name_or_path, weights=self.loaded.weights)

    async def Reply(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """The turn's reply, standalone: what its token log holds already, then the rest (the code
        path of the queue's workers, `work`)."""
        clock = StageClock("llm")
        clock.received()
        async with status_on_error(context, "llm"):
            stop = threading.Event()
            context.add_done_callback(lambda _: stop.set())
            async for step in self._reply(request, stop, clock, replay=True):
                yield step

    async def work(self, draining: asyncio.Event) -> None:
        """The llm's queue worker: turns taken from `sv:work:llm` (services/store/work_queue.py) until the drain,
        as many at once as a batch holds."""
        settings = self.settings
        queue = WorkQueue(self.redis.client, "llm", settings.worker_name_of("llm"), settings.work)
        capacity = settings.llm_concurrency or max(1, settings.llm.max_batch_size)
        await run_worker(queue, self._work, capacity, draining, self._dead)

    async def _work(self, item: WorkItem) -> None:
        """One turn from the queue. A request that can never succeed ends the turn's log with its
        reason (and is acked); anything else raised is a failed delivery, retried by the queue."""
        request = work_request(item, pb.ReplyRequest)
        logs.bind(session_id=request.session_id, turn_id=request.turn_id)
        clock = StageClock("llm")
        clock.received()
        with tracing.work_span("llm", "llm Llm/Reply", item.fields, turn_id=request.turn_id, work_id=item.id):
            await work_through_log(self._reply(request, threading.Event(), clock, replay=False),
                                   lambda why: _end_log(self.redis.client, request.turn_id, "error", why, self._ttl))

    async def _dead(self, item: WorkItem, letter: dict[str, str]) -> None:
        """A dead-lettered turn's readers (gateway, tts) learn that it failed, and why."""
        error = f"INTERNAL: llm gave up after {letter['deliveries']} tries: {letter['error']}"
        await _end_log(self.redis.client, item.fields.get("turn", ""), "error", error, self._ttl)

    @property
    def _ttl(self) -> int:
        return self.settings.token_stream_ttl_s

    async def _reply(self, request, stop: threading.Event, clock: StageClock, replay: bool) -> AsyncIterator:
        """The turn's reply as ReplySteps, each written to its token log before it is yielded.

        The writer claims the log first (an earlier holder is fenced out from then on). A log with
        steps in it already, left by a worker that died, is resumed: the engine prefills the
        turn's recorded prompt plus the tokens logged and goes on at the next seq, so the reply is
        the one the first worker would have written. `replay`: yield the logged steps too.
        A cancel (the key the gateway sets) is seen at each append and stops within a step.
        """
        if not request.turn_id:
            raise ValueError("turn_id is empty")
        turn_id = request.turn_id
        session = await self.sessions.require(request.session_id)
        await self.turns.require(turn_id, request.session_id)
        writer = TurnLogWriter(self.redis.client, turn_id, "llm", token_stream_key(turn_id), self._ttl)
        next_seq = await writer.claim()
        logged = await read_token_log(self.redis.client, turn_id) if next_seq else []
        if replay:
            for entry in logged:
                yield _logged_step(entry)
        if logged and logged[-1].end:
            await self._record_exchange(request, "".join(e.text for e in logged), logged[-1].finish_reason)
            return
        if await self.turns.cancelled(turn_id):
            await writer.append(_entry_fields(DecodeStep(next_seq, (), "", "cancelled")))
            yield pb.ReplyStep(seq=next_seq, end=True, finish_reason="cancelled")
            return
        # After the score of the session in progress: the plan reads the prefix cache the score fills.
        await self._after_the_score(request.session_id)
        generation, degradations = await self._generation_request(request, session)
        if logged:
            generation = generation.resumed([t for e in logged for t in e.token_ids], next_seq)
            log.info("turn %s: resuming at seq %d after %d tokens", turn_id, next_seq, len(generation.resume_tokens))
        reply_text, reason = "".join(e.text for e in logged), None
        try:
            async for step in self._steps(generation, stop.is_set):
                clock.emitted()
                reply_text += step.text_delta
                reply = _reply_step(step, clock, degradations)
                extra = {"cached": step.prefix_cached_tokens} if step.seq == 0 else {}
                if reply.end:
                    extra["times"] = json_format.MessageToJson(reply.times, indent=None)
                if await writer.append(_entry_fields(step, extra)):
                    stop.set()  # cancelled: the engine stops before its next step
                reason = step.finish_reason
                if step.stats is not None:  # the last step: the reply's decoding statistics
                    metrics.observe_decoding(generation.drafter, step.stats)
                yield reply
        except (asyncio.CancelledError, GeneratorExit):
            if replay and reason is None:  # the caller went away: readers of the log must see its end
                self._end_stream_later(writer, "cancelled")
            raise
        await self._record_exchange(request, reply_text, reason or "")

    async def _after_the_score(self, session_id: str) -> None:
        """The gateway asks a turn's end-of-turn score and queues its reply at once; the reply's
        plan and prefill wait for a score of its session in progress, so that the prefill reuses
        the conversation the score prefilled, and the plan (which weighs the prefill against the
        budget) sees it cached: while the score runs it holds the session's cached prefix."""
        if (scoring := self._scoring.get(session_id)) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(scoring.wait(), SCORE_WAIT_S)

    async def _record_exchange(self, request, reply_text: str, reason: str) -> None:
        """After a dialogue reply that ended normally, the exchange joins the session's history, once
        however many workers saw the turn end (unless the caller records it: `defer_history`)."""
        dialogue = TASKS.get(request.task, Task.DIALOGUE) is Task.DIALOGUE
        if (dialogue and reply_text.strip() and not request.defer_history and reason in FINISHED
                and await self.turns.once(request.turn_id, "history")):
            await self.sessions.append(request.session_id, Exchange(request.user_text, reply_text.strip()))

    async def EndOfTurn(self, request, context: grpc.aio.ServicerContext):
        """P(the user's message ends after user_text), given the session's conversation
        (pipeline.llm.end_of_turn); on the model thread, between decode steps, never beside one,
        and ahead of the replies' steps: the turn's reply waits for it (`_after_the_score`)."""
        done = self._scoring[request.session_id] = asyncio.Event()
        try:
            async with status_on_error(context, "llm"):
                if not request.user_text.strip():
                    raise ValueError("user_text is empty")
                persona, history = await self._conversation(request)

                def score():
                    self._check_fits(request.user_text, persona)
                    return self._scorer().score(request.user_text, persona, history,
                                                prefix_cache=self._scored_cache, session_key=request.session_id)

                result = await self.worker.call(score, due_s=0.0)
                return pb.EndOfTurnScore(probability=result.probability, prompt_tokens=result.prompt_tokens,
                                         compute_ms=result.compute_ms, cached_tokens=result.cached_tokens)
        finally:
            done.set()
            if self._scoring.get(request.session_id) is done:
                del self._scoring[request.session_id]

    async def Prepare(self, request, context: grpc.aio.ServicerContext):
        """The session's conversation prefilled into the prefix cache (where it keeps sessions), so a
        turn's score and reply prefill only the user's words; on the model thread, at its turn.

        With `user_text` (the words so far while the user speaks) those words too, but only while
        no reply is decoding: this is time the model thread has spare, and a reply's next step
        must not wait behind it."""
        async with status_on_error(context, "llm"):
            persona, history = await self._conversation(request)
            if self._scored_cache is None:
                return pb.Prepared()
            text = request.user_text
            if text and self._decoding():
                return pb.Prepared(skipped=True)

            def prepare():
                if text and self.scheduler is not None and self.scheduler.busy:
                    return None  # a reply began while this waited: it holds the session's prefix now
                self._check_fits(text, persona)
                return self._scorer().prepare(persona, history, self._scored_cache, request.session_id, text)

            # the words' prefill after anything else waiting for the thread (the conversation's, at once)
            result = await self.worker.call(prepare, due_s=time.time() + PREPARE_YIELD_S if text else None)
            if result is None:
                return pb.Prepared(skipped=True)
            return pb.Prepared(prompt_tokens=result.prompt_tokens, compute_ms=result.compute_ms,
                               skipped=bool(text) and not result.words)

    def _decoding(self) -> bool:
        """Replies are decoding, or waiting to."""
        return self.scheduler.busy if self.scheduler is not None else self.worker.busy

    async def _conversation(self, request) -> tuple[str, tuple[Exchange, ...]]:
        """The persona and history a score sees: the request's persona, else the session's, else the default."""
        session = await self.sessions.require(request.session_id)
        persona = request.system_prompt or session.get("system_prompt") or DEFAULT_PERSONA
        return persona, await self.sessions.history(request.session_id)

    def _scorer(self) -> EndOfTurnScorer:
        """Built at the first use: with a prefix cache it reads all of the history that fits, as the reply does."""
        if self._end_of_turn is None:
            self._end_of_turn = EndOfTurnScorer(self.loaded, **(
                {"max_history_exchanges": 1_000, "max_history_tokens": self.loaded.context_tokens}
                if self._scored_cache is not None else {}))
        return self._end_of_turn

    def _check_fits(self, user_text: str, persona: str) -> None:
        """PromptTooLongError where the text and persona alone overflow the model's context: one pass
        over such a prompt took minutes and the OOM killer took the llm (a fuzzed 100,000-character
        text). A token holds at least a byte, so a short text is let through without tokenizing it."""
        context = self.loaded.context_tokens
        if len(user_text.encode()) + len(persona.encode()) + 64 > context:
            fit_history(self.loaded.tokenizer, Task.DIALOGUE, user_text, persona, (), context)

    def _end_stream_later(self, writer: TurnLogWriter, reason: str) -> None:
        """Write the end entry from a task of its own: the reply's generator may be closing."""
        async def end() -> None:
            with contextlib.suppress(LogMoved, LogGap, *REDIS_ERRORS):
                await writer.append(_entry_fields(DecodeStep(writer.next_seq, (), "", reason)))

        task = asyncio.get_running_loop().create_task(end())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _generation_request(self, request, session: dict[str, str]) -> tuple[GenerationRequest, tuple[str, ...]]:
        """The request to decode, as planned against the turn's budget, and what the plan gave up.

        The plan (prompt ids, token limit, drafter) is recorded with the turn the first time; a
        worker resuming the turn decodes the recorded one, whatever time is left by then.
        """
        if not request.user_text.strip():
            raise ValueError("user_text is empty")
        options = self.settings.llm
        recorded = await self.redis.client.hget(turn_key(request.turn_id), "llm_plan")
        if recorded is None:
            generation, plan = await self._plan(request, session)
            recorded = await self.turns.plan(request.turn_id, "llm", json.dumps({
                "prompt": list(generation.prompt_ids), "max_new_tokens": generation.max_new_tokens,
                "drafter": generation.drafter, "max_draft_tokens": generation.max_draft_tokens,
                "caption_of": generation.caption_of, "degradations": list(plan.degradations)}))
        kept = json.loads(recorded)
        generation = GenerationRequest(
            tuple(kept["prompt"]), kept["max_new_tokens"], kept["drafter"], _sampling(request.sampling),
            max_draft_tokens=kept["max_draft_tokens"], adaptive_draft=options.adaptive_draft,
            draft_branches=options.draft_branches if not kept.get("caption_of") else 0,
            stop_strings=tuple(request.stop), session_key=request.session_id, caption_of=kept.get("caption_of", ""))
        self.generator.check(generation)
        return generation, tuple(kept["degradations"])

    async def _plan(self, request, session: dict[str, str]) -> tuple[GenerationRequest, Plan]:
        """The request as planned now against the turn's budget. A caption is not planned down: its length
        is its transcript's, and it is held to the transcript's words (pipeline/llm/caption_constraint.py)
        whatever the caller asks: no request reaches an unconstrained rewrite."""
        task = TASKS.get(request.task, Task.DIALOGUE)
        if task is Task.CAPTION:
            generation = caption_request(self.generator, request.user_text, request.drafter or TRANSCRIPT,
                                         _sampling(request.sampling), self.settings.llm.max_draft_tokens,
                                         session_key=request.session_id)
            self.generator.check(generation)
            return generation, Plan(generation.drafter, generation.max_new_tokens, generation.max_draft_tokens)
        history = await self.sessions.history(request.session_id) if task is Task.DIALOGUE else ()
        persona = request.system_prompt or session.get("system_prompt") or DEFAULT_PERSONA
        options = self.settings.llm
        asked = Plan(request.drafter or options.drafter, request.max_new_tokens or options.max_new_tokens,
                     options.max_draft_tokens)
        budget = _budget(request)
        prompts = self._prompts(task, request.user_text, persona, history, asked.max_new_tokens,
                                budget.deadline_unix_ms != 0)
        key = request.session_id
        choices = tuple(PromptChoice(kept, len(ids) - self.generator.prefix_cache.reusable(key, ids))
                        for kept, ids in prompts)
        plan = self.policy.plan(budget, asked, choices, self.generator.costs.costs())
        if plan.degradations:
            log.info("turn %s: %.0f ms left, first phrase needs ~%.0f ms: %s", request.turn_id, plan.time_left_ms,
                     plan.estimate_ms, ", ".join(plan.degradations))
        generation = GenerationRequest(
            tuple(prompts[plan.prompt][1]), plan.max_new_tokens, plan.drafter, _sampling(request.sampling),
            max_draft_tokens=plan.max_draft_tokens, adaptive_draft=options.adaptive_draft,
            draft_branches=options.draft_branches, stop_strings=tuple(request.stop), session_key=key)
        self.generator.check(generation)
        return generation, plan

    def _prompts(self, task: Task, user_text: str, persona: str, history: tuple[Exchange, ...], max_new: int,
                 budgeted: bool) -> list[tuple[int, list[int]]]:
        """(exchanges of history at most, prompt ids): the fullest prompt that fits the context, then,
        for a turn with a budget, the prompts the budget may fall back to (the newest exchange, none)."""
        room = self.loaded.context_tokens - max_new
        fallbacks = [kept for kept in (1, 0) if kept < len(history)] if budgeted else []
        return [(kept, fit_history(self.loaded.tokenizer, task, user_text, persona,
                                   history[len(history) - kept:], room))
                for kept in (len(history), *fallbacks)]


def _sampling(s) -> SamplingOptions:
    return SamplingOptions(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                           repetition_penalty=s.repetition_penalty or 1.0,
                           seed=s.seed if s.HasField("seed") else None).validate()


def _entry_fields(step: DecodeStep, extra: dict | None = None) -> dict[str, str | int]:
    return TokenEntry(
        seq=step.seq,
        token_ids=step.token_ids,
        text=step.text_delta,
        accepted=step.accepted,
        emitted_unix_ms=now_ms(),
        end=step.finish_reason is not None,
        finish_reason=step.finish_reason or "",
        extra={k: str(v) for k, v in (extra or {}).items()},
    ).fields()


def _logged_step(entry: TokenEntry):
    """A step as its log holds it (a reply resumed or read again)."""
    step = pb.ReplyStep(seq=max(0, entry.seq), token_ids=list(entry.token_ids), text_delta=entry.text,
                        accepted=entry.accepted, end=entry.end, finish_reason=entry.finish_reason,
                        prefix_cached_tokens=int(entry.extra.get("cached", 0)))
    if "times" in entry.extra:
        json_format.Parse(entry.extra["times"], step.times)
    return step


async def _end_log(redis, turn_id: str, reason: str, error: str, ttl_s: int) -> None:
    """End a turn's token log that no worker will write any more (its request refused, given up)."""
    seq = int(await redis.hget(turn_key(turn_id), "llm_seq") or -1) + 1
    entry = TokenEntry(seq, (), "", 0, now_ms(), end=True, finish_reason=reason, extra={"error": error})
    await TokenStreamWriter(redis, turn_id, ttl_s).append(entry)


def _budget(request) -> TurnBudget:
    if not request.HasField("budget"):
        return TurnBudget()
    b = request.budget
    return TurnBudget(b.budget_ms, b.speech_end_unix_ms, b.deadline_unix_ms)


def _reply_step(step: DecodeStep, clock: StageClock, degradations: tuple[str, ...]):
    last = step.finish_reason is not None
    times = None
    if last:
        times = clock.to_proto(common.StageTimes)
        times.degradations.extend(degradations)
    return pb.ReplyStep(
        drafted=step.drafted,
        stats_json=json.dumps(step.stats.as_dict()) if step.stats else "",
        seq=step.seq,
        token_ids=list(step.token_ids),
        text_delta=step.text_delta,
        accepted=step.accepted,
        end=last,
        finish_reason=step.finish_reason or "",
        times=times,
        prefix_cached_tokens=step.prefix_cached_tokens,
    )


async def build(settings: Settings) -> Service:
    """The llm service for run_service: the model loaded and warmed before it serves."""
    redis = await open_redis(settings)
    print(f"specvox llm loading {settings.llm.model} ({settings.llm.dtype} on {settings.llm.device})", flush=True)
    loaded = load_model(settings.llm)
    servicer = LlmServicer(settings, loaded, redis)
    servicer.generator.warm_up(drafters=tuple(dict.fromkeys(("none", settings.llm.drafter))))
    return Service("llm", lambda server: pb_grpc.add_LlmServicer_to_server(servicer, server),
                   workers=[servicer.work], close=redis.close)


if __name__ == "__main__":
    service_main(build)
