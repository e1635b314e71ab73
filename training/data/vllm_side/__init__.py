"""Modules that run inside vLLM's own Python environment (training.data.vllm_capture starts them there, with this
folder on PYTHONPATH); they import vLLM and nothing of this project, and nothing here imports them."""
