"""The llm gRPC service: writes each verify step to the turn's Redis stream and streams it back."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import grpc

from pipeline.llm.batch import BatchedDecoder, BatchScheduler
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator
from pipeline.llm.model import LoadedModel, load_model
from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, fit_history
from pipeline.llm.sampling import SamplingOptions
from services.grpc_server import ModelWorker, StageClock, serve, status_on_error
from services.protos import load
from services.redis_store import SessionStore, TokenEntry, TokenStreamWriter, TurnStore, now_ms
from services.runtime import RedisContext, open_redis
from services.settings import Settings

pb, pb_grpc = load("llm")
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

    def _steps(self, generation: GenerationRequest, should_stop) -> AsyncIterator[DecodeStep]:
        if self.scheduler is not None:
            return self.scheduler.steps(generation, should_stop)
        return self.worker.iterate(self.generator.steps(generation, should_stop))

    async def Reply(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("llm")
        clock.received()
        async with status_on_error(context, "llm"):
            session = await self.sessions.require(request.session_id)
            await self.turns.require(request.turn_id, request.session_id)
            generation = await self._generation_request(request, session)
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
                    yield _reply_step(step, clock)
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
            if getattr(self, "_end_of_turn", None) is None:  # built at the first call: a few token lookups
                from pipeline.llm.end_of_turn import EndOfTurnScorer

                self._end_of_turn = EndOfTurnScorer(self.loaded)
            result = await self.worker.call(self._end_of_turn.score, request.user_text, persona, history)
            return pb.EndOfTurnScore(probability=result.probability, prompt_tokens=result.prompt_tokens,
                                     compute_ms=result.compute_ms)

    def _end_stream_later(self, writer: TokenStreamWriter, reason: str) -> None:
        """Write the end entry from a task of its own: this generator may be closing."""
        entry = TokenEntry(-1, (), "", 0, now_ms(), end=True, finish_reason=reason)
        task = asyncio.get_running_loop().create_task(writer.append(entry))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _generation_request(self, request, session: dict[str, str]) -> GenerationRequest:
        if not request.user_text.strip():
            raise ValueError("user_text is empty")
        if not request.turn_id:
            raise ValueError("turn_id is empty")
        task = TASKS.get(request.task, Task.DIALOGUE)
        history = await self.sessions.history(request.session_id) if task is Task.DIALOGUE else ()
        max_new = request.max_new_tokens or self.settings.llm.max_new_tokens
        prompt_ids = fit_history(
            self.loaded.tokenizer,
            task,
            request.user_text,
            session.get("system_prompt") or DEFAULT_PERSONA,
            history,
            self.loaded.context_tokens - max_new,
        )
        options = self.settings.llm
        generation = GenerationRequest(
            tuple(prompt_ids), max_new, request.drafter or options.drafter, _sampling(request.sampling),
            max_draft_tokens=options.max_draft_tokens, adaptive_draft=options.adaptive_draft,
            stop_strings=tuple(request.stop), session_key=request.session_id)
        self.generator.check(generation)
        return generation


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


def _reply_step(step: DecodeStep, clock: StageClock):
    last = step.finish_reason is not None
    return pb.ReplyStep(
        drafted=step.drafted,
        stats_json=json.dumps(step.stats.as_dict()) if step.stats else "",
        seq=step.seq,
        token_ids=list(step.token_ids),
        text_delta=step.text_delta,
        accepted=step.accepted,
        end=last,
        finish_reason=step.finish_reason or "",
        times=clock.to_proto(pb.StageTimes) if last else None,
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
