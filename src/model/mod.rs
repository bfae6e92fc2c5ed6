//! Decoder-only transformers (Llama, Qwen2, Qwen3) in the Hugging Face format.
