//! Decoder-only transformers (Llama, Qwen2, Qwen3, Qwen3.5, Qwen3-MoE) in the Hugging Face format.

pub mod attention_gate;
pub mod delta_net;
pub mod delta_net_chunked;
pub mod gemma3;
pub mod graph_checkpoint;
pub mod hub;
pub mod kv_cache;
pub mod linear;
pub mod logprobs;
pub mod model_config;
pub mod moe;
pub mod named_tensors;
pub mod ops;
pub mod rope;
pub mod row_adapters;
pub mod safetensors_file;
pub mod sampler_weights;
pub mod sequence_logprobs;
pub mod sharded_weights;
pub mod sliding_window;
pub mod tape;
pub mod token_ids;
pub mod transformer;
pub mod weight_update;
pub mod weights;

pub use kv_cache::KvCache;
pub use model_config::{Arch, ModelConfig};
pub use named_tensors::NamedTensors;
pub use sampler_weights::SamplerWeights;
pub use token_ids::check_token_ids;
pub use transformer::Transformer;
pub mod chat_template;
pub mod init;
pub mod lora;
pub mod tokenizer;
