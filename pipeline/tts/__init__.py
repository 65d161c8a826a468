"""The TTS stage: phrases cut from a growing reply, synthesized with their place in the timeline."""
