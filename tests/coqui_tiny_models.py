"""Build tiny random-weight Coqui models, as their checkpoints and configs (run by the Coqui env's python).

The Coqui tests need real models of their own; their weights are random, so they speak
noise, but their shape, tokenizer and rate are those of the real kind.

  python tests/coqui_tiny_models.py vits DIR [SPEAKERS [LANGUAGES]]
      DIR/model.pth and DIR/config.json, a VITS with a character set (no phonemizer) at
      16 kHz, loadable by `TTS(model_path=…, config_path=…)`. SPEAKERS and LANGUAGES
      (comma-separated names) make it multi-speaker and multilingual (speaker and language
      embeddings).
  python tests/coqui_tiny_models.py xtts DIR
      DIR/model.pth, config.json and vocab.json, an XTTS (one GPT layer, a character-level
      tokenizer for English) that loads from its folder, clones a voice from a recording and
      streams (`inference_stream`). Its GPT never learned to stop, so every phrase runs to
      `gpt_max_audio_tokens` (48 codes, about 2.2 s at 24 kHz).
"""

from __future__ import annotations

import sys
from pathlib import Path

VITS_RATE_HZ = 16_000  # not Piper's 22,050, so a test can tell which backend spoke


def vits(folder: Path, speakers: list[str] | None = None, languages: list[str] | None = None) -> None:
    import torch
    from TTS.tts.configs.shared_configs import BaseAudioConfig, CharactersConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig
    from TTS.tts.models.vits import Vits

    torch.manual_seed(0)
    config = VitsConfig(
        audio=BaseAudioConfig(sample_rate=VITS_RATE_HZ),
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
    torch.save({"model": model.state_dict()}, folder / "model.pth")
    config.save_json(str(folder / "config.json"))


def xtts(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from TTS.tts.configs.xtts_config import XttsConfig
    from TTS.tts.layers.xtts.tokenizer import VoiceBpeTokenizer
    from TTS.tts.models.xtts import Xtts, XttsArgs

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[STOP]", "[UNK]", "[SPACE]", "[START]", "[en]"]  # what VoiceBpeTokenizer and the GPT expect
    symbols = specials + list("abcdefghijklmnopqrstuvwxyz.,!?'-")
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="[UNK]"))
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "vocab.json"))
    torch.manual_seed(0)
    config = XttsConfig(model_args=XttsArgs(gpt_layers=1, gpt_n_model_channels=64, gpt_n_heads=2,
                                            decoder_input_dim=64, gpt_max_audio_tokens=48))
    model = Xtts(config)
    model.tokenizer = VoiceBpeTokenizer(vocab_file=folder / "vocab.json")
    model.init_models()
    torch.save({"model": model.state_dict()}, folder / "model.pth")
    config.save_json(str(folder / "config.json"))


if __name__ == "__main__":
    kind, folder, *names = sys.argv[1:]
    if kind == "vits":
        vits(Path(folder), *[n.split(",") for n in names])
    else:
        xtts(Path(folder))
