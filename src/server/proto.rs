//! The protobuf messages of the Tinker wire protocol (`docs/specs/tinker_public.proto`), written by
//! hand as prost structs so that building needs no `protoc`. Only the messages the server reads
//! or writes are here; field numbers and types follow the schema exactly.

use std::collections::HashMap;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardRequest {
    #[prost(string, tag = "1")]
    pub model_id: String,
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LossConfigValue {
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

pub mod loss_config_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(double, tag = "1")]
        Number(f64),
        #[prost(string, tag = "2")]
        Text(String),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Datum {
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
    /// Provenance: runs tiling `model_input` (3) and `loss_fn_inputs.target_tokens` (4).
    #[prost(message, repeated, tag = "3")]
    pub model_input_spans: Vec<ProvenanceSpan>,
    #[prost(message, repeated, tag = "4")]
    pub loss_fn_input_spans: Vec<ProvenanceSpan>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProvenanceSpan {
    #[prost(oneof = "provenance_span::Span", tags = "1, 2")]
    pub span: Option<provenance_span::Span>,
}

pub mod provenance_span {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Span {
        #[prost(message, tag = "1")]
        PromptTokens(super::SpanRun),
        #[prost(message, tag = "2")]
        SampledTokens(super::SpanRun),
    }
}

/// `PromptProvenanceSpan` and `SampledProvenanceSpan` (the same fields).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SpanRun {
    #[prost(string, tag = "1")]
    pub sequence_id: String,
    #[prost(int64, tag = "2")]
    pub offset: i64,
    #[prost(int64, tag = "3")]
    pub length: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Chunk {
    #[prost(oneof = "chunk::Chunk", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Chunk>,
}

pub mod chunk {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Chunk {
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        /// Images are not supported (text models only); kept to name them in the error.
        #[prost(bytes, tag = "2")]
        Image(Vec<u8>),
        #[prost(bytes, tag = "3")]
        Dmel(Vec<u8>),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EncodedTextChunk {
    /// int32 little-endian.
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SparseCsr {
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub crow_indices: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    pub col_indices: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Tensor {
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

pub mod tensor {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        #[prost(bytes, tag = "1")]
        Dense(Vec<u8>),
        #[prost(message, tag = "2")]
        SparseCsr(super::SparseCsr),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BatchedTensor {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    /// int64 little-endian byte offsets into `data`, one per datum plus one.
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayRecord {
    #[prost(string, tag = "1")]
    pub type_tag: String,
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardOutput {
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum DType {
    Unspecified = 0,
    Float32 = 1,
    Int64 = 2,
    Int32 = 3,
    Bfloat16 = 4,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum StopReason {
    Stop = 0,
    Length = 1,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SampleResponse {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// float32 little-endian, one per prompt token (NaN where there is none: index 0).
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
    #[prost(message, optional, tag = "3")]
    pub topk_prompt_logprobs: Option<TopkLogprobs>,
    #[prost(int32, tag = "4")]
    pub prompt_cache_hit_tokens: i32,
}

/// Dense [length, k] matrices; empty slots hold token 0 with log-prob −99999 (a row of only
/// those reads as None in the SDK).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TopkLogprobs {
    /// int32 little-endian.
    #[prost(bytes = "vec", tag = "1")]
    pub token_ids: Vec<u8>,
    /// float32 little-endian.
    #[prost(bytes = "vec", tag = "2")]
    pub logprobs: Vec<u8>,
    #[prost(uint32, tag = "3")]
    pub k: u32,
    #[prost(uint32, tag = "4")]
    pub length: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SampledSequence {
    #[prost(enumeration = "StopReason", tag = "1")]
    pub stop_reason: i32,
    /// int32 little-endian.
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    /// float32 little-endian.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
    #[prost(message, optional, tag = "4")]
    pub topk_sampled_logprobs: Option<TopkLogprobs>,
}
