"""Build a tiny random-weight VITS as a Coqui checkpoint + config (run by the Coqui env's python).

The Coqui tests need a real model of their own: `python tests/coqui_tiny_vits.py DIR
[SPEAKERS [LANGUAGES]]` writes DIR/model.pth and DIR/config.json, loadable by
`TTS(model_path=…, config_path=…)`. SPEAKERS and LANGUAGES (comma-separated names) make it a
multi-speaker, multilingual VITS with speaker and language embeddings. Its weights are
random, so it speaks noise; its shape, character set and rate are those of a real VITS.
"""

from __future__ import annotations

import sys
from pathlib import Path

SAMPLE_RATE_HZ = 16_000  # not Piper's 22,050, so a test can tell which backend spoke


def build(folder: Path, speakers: list[str] | None = None, languages: list[str] | None = None) -> tuple[Path, Path]:
    import torch
    from TTS.tts.configs.shared_configs import BaseAudioConfig, CharactersConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig
    from TTS.tts.models.vits import Vits

    torch.manual_seed(0)
    config = VitsConfig(
        audio=BaseAudioConfig(sample_rate=SAMPLE_RATE_HZ),
        model_args=VitsArgs(
            hidden_channels=32, hidden_channels_ffn_text_encoder=64, num_heads_text_encoder=2,
            num_layers_text_encoder=2, num_layers_posterior_encoder=2, num_layers_flow=2,
            upsample_initial_channel_decoder=64, init_discriminator=False,
            use_speaker_embedding=bool(speakers), speaker_embedding_channels=16,
            use_language_embedding=bool(languages),
        ),
        speakers=speakers or [],
        languages=languages or [],
        text_cleaner="basic_cleaners",
        use_phonemes=False,
        characters=CharactersConfig(
            characters_class="TTS.tts.models.vits.VitsCharacters",
            pad="<PAD>", eos="<EOS>", bos="<BOS>", blank="<BLNK>",
            characters="abcdefghijklmnopqrstuvwxyz", punctuations="!'(),-.:;? ",
        ),
    )
    model = Vits(config)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint, config_path = folder / "model.pth", folder / "config.json"
    torch.save({"model": model.state_dict()}, checkpoint)
    config.save_json(str(config_path))
    return checkpoint, config_path


if __name__ == "__main__":
    names = [arg.split(",") for arg in sys.argv[2:4]]
    for path in build(Path(sys.argv[1]), *names):
        print(path)
