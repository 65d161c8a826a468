"""The llm gRPC service: writes each verify step to the turn's Redis stream and streams it back.

A reply keeps its session's KV cache for the next one (`llm.prefix_cache_sessions`), and a
turn with a budget that runs late is planned down before it prefills (pipeline/llm/budget.py);
what it gave up is listed in the last step's `times.degradations`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator

import grpc

from pipeline.llm.batch import BatchedDecoder, BatchScheduler
from pipeline.llm.budget import BudgetOptions, BudgetPolicy, Plan, PromptChoice, TurnBudget
from pipeline.llm.end_of_turn import EndOfTurnScorer
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator
from pipeline.llm.model import LoadedModel, load_model
from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, fit_history
from pipeline.llm.sampling import SamplingOptions
from pipeline.models import resolve_llm
from services.grpc_server import ModelWorker, StageClock, serve, status_on_error
from services.protos import load, load_common
from services.redis_store import SessionStore, TokenEntry, TokenStreamWriter, TurnStore, now_ms
from services.runtime import RedisContext, open_redis
from services.settings import Settings

log = logging.getLogger(__name__)
pb, pb_grpc = load("llm")
common = load_common()
TASKS = {pb.ReplyRequest.CAPTION: Task.CAPTION}


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
        batch = settings.llm.max_batch_size
        self.scheduler = BatchScheduler(BatchedDecoder(self.generator, batch), self.worker.call) if batch != 1 else None
        # With a prefix cache the end-of-turn score runs on the session's conversation as the reply
        # will see it (all the history that fits), so that the reply reuses what the score prefilled.
        self._scored_cache = self.generator.prefix_cache if self.generator.prefix_cache.sessions else None
        # Built at the first EndOfTurn: a model that is not ChatML still serves Reply, and only
        # EndOfTurn says why it cannot score.
        self._end_of_turn: EndOfTurnScorer | None = None
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
        clock = StageClock("llm")
        clock.received()
        async with status_on_error(context, "llm"):
            session = await self.sessions.require(request.session_id)
            await self.turns.require(request.turn_id, request.session_id)
            generation, plan = await self._generation_request(request, session)
            cancelled = threading.Event()
            context.add_done_callback(lambda _: cancelled.set())
            writer = TokenStreamWriter(self.redis.client, request.turn_id, self.settings.token_stream_ttl_s)
            reply_text, ended, reason = "", False, "error"
            try:
                async for step in self._steps(generation, cancelled.is_set):
                    clock.emitted()
                    reply_text += step.text_delta
                    await writer.append(_entry(step))
                    ended = step.finish_reason is not None
                    yield _reply_step(step, clock, plan.degradations)
            except (asyncio.CancelledError, GeneratorExit):
                reason = "cancelled"
                raise
            finally:
                if not ended:  # cancelled or failed: readers of the stream must still see its end
                    self._end_stream_later(writer, reason)
            dialogue = TASKS.get(request.task, Task.DIALOGUE) is Task.DIALOGUE
            if dialogue and reply_text.strip() and not request.defer_history:
                await self.sessions.append(request.session_id, Exchange(request.user_text, reply_text.strip()))

    async def EndOfTurn(self, request, context: grpc.aio.ServicerContext):
        """P(the user's message ends after user_text), given the session's conversation
        (pipeline.llm.end_of_turn); on the model thread, between decode steps, never beside one."""
        async with status_on_error(context, "llm"):
            session = await self.sessions.require(request.session_id)
            if not request.user_text.strip():
                raise ValueError("user_text is empty")
            persona = request.system_prompt or session.get("system_prompt") or DEFAULT_PERSONA
            history = await self.sessions.history(request.session_id)
            scorer = self._end_of_turn = self._end_of_turn or EndOfTurnScorer(
                self.loaded, **({"max_history_exchanges": 1_000, "max_history_tokens": self.loaded.context_tokens}
                                if self._scored_cache is not None else {}))
            result = await self.worker.call(lambda: scorer.score(
                request.user_text, persona, history, prefix_cache=self._scored_cache,
                session_key=request.session_id))
            return pb.EndOfTurnScore(probability=result.probability, prompt_tokens=result.prompt_tokens,
                                     compute_ms=result.compute_ms)

    def _end_stream_later(self, writer: TokenStreamWriter, reason: str) -> None:
        """Write the end entry from a task of its own: this generator may be closing."""
        entry = TokenEntry(-1, (), "", 0, now_ms(), end=True, finish_reason=reason)
        task = asyncio.get_running_loop().create_task(writer.append(entry))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _generation_request(self, request, session: dict[str, str]) -> tuple[GenerationRequest, Plan]:
        """The request to decode, as planned against the turn's budget."""
        if not request.user_text.strip():
            raise ValueError("user_text is empty")
        if not request.turn_id:
            raise ValueError("turn_id is empty")
        task = TASKS.get(request.task, Task.DIALOGUE)
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
            stop_strings=tuple(request.stop), session_key=key)
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


def _entry(step: DecodeStep) -> TokenEntry:
    return TokenEntry(
        seq=step.seq,
        token_ids=step.token_ids,
        text=step.text_delta,
        accepted=step.accepted,
        emitted_unix_ms=now_ms(),
        end=step.finish_reason is not None,
        finish_reason=step.finish_reason or "",
    )


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


async def run(settings: Settings) -> None:
    redis = await open_redis(settings)
    print(f"specvox llm loading {settings.llm.model} ({settings.llm.dtype} on {settings.llm.device})", flush=True)
    loaded = load_model(settings.llm)
    servicer = LlmServicer(settings, loaded, redis)
    servicer.generator.warm_up(drafters=tuple(dict.fromkeys(("none", settings.llm.drafter))))
    await serve(
        "llm",
        lambda server: pb_grpc.add_LlmServicer_to_server(servicer, server),
        [pb.DESCRIPTOR.services_by_name["Llm"].full_name],
        f"{settings.host}:{settings.llm_port}",
        settings.max_message_bytes,
        on_stop=redis.close,
    )
