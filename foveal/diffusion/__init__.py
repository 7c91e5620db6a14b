"""Diffusion language models: masked diffusion (LLaDA) and block diffusion (SDAR) on the Llama-family
decoders, denoised in the engine's one loop."""
