"""specvox's engine and stage logic: plain Python, no gRPC and no Redis."""

import os

# The stages share a machine's cores (`specvox up` runs asr, llm and tts side by side), and
# OpenMP's default lets idle threads spin at every barrier. A spinning torch or CTranslate2
# thread holds a core that another stage needs, and a stage whose thread lost its core waits
# at the barrier for it: measured on 2 shared cores, plain decoding fell from ~10 to ~2 tok/s
# and a 52-token prefill from 0.18 to 2.1 s. Passive waiting yields the core instead. It must
# be set before torch or ctranslate2 loads OpenMP, hence here; an OMP_WAIT_POLICY already set
# (ACTIVE on a machine given to one stage alone) is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
