"""specvox's servers, stores and command line; the engine and stage logic live in `pipeline`."""

# Where each service's `build(settings)` lives: `python -m MODULE` runs it, `specvox up` starts it.
SERVICE_MODULES = {
    "gateway": "services.gateway.service",
    "asr": "services.stages.asr",
    "llm": "services.stages.llm",
    "tts": "services.stages.tts",
}
