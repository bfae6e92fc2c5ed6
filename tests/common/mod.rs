//! Helpers shared by the integration tests: fixture paths and the golden tensors.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};

pub mod golden_checks;

pub const ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// The dense families' fixtures (`ARCHS`), and the 2026 families' (`qwen3_5`).
pub fn fixture_dir(arch: &str) -> PathBuf {
    let set =
        if matches!(arch, "qwen3_5" | "qwen3_moe" | "gemma3") { "tests/fixtures/hf-2026" } else { "tests/fixtures/hf" };
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(set).join(arch)
}

pub struct Golden {
    pub tensors: HashMap<String, Tensor>,
    pub json: serde_json::Value,
}

impl Golden {
    /// The AdamW step transformers took (`adamw` in the fixture), without clipping.
    pub fn adamw(&self) -> oxrl::worker::AdamParams {
        let a = &self.json["adamw"];
        oxrl::worker::AdamParams {
            learning_rate: a["lr"].as_f64().unwrap(),
            beta1: a["betas"][0].as_f64().unwrap(),
            beta2: a["betas"][1].as_f64().unwrap(),
            eps: a["eps"].as_f64().unwrap(),
            weight_decay: a["weight_decay"].as_f64().unwrap(),
            grad_clip_norm: 0.0,
        }
    }

    pub fn load(arch: &str) -> Golden {
        let dir = fixture_dir(arch);
        let tensors = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap();
        let json = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        Golden { tensors, json }
    }
    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors.get(name).unwrap_or_else(|| panic!("golden tensor {name} missing"))
    }
    pub fn i64_2d(&self, name: &str) -> Vec<Vec<i64>> {
        self.get(name).to_dtype(DType::I64).unwrap().to_vec2().unwrap()
    }
    pub fn f32_2d(&self, name: &str) -> Vec<Vec<f32>> {
        self.get(name).to_dtype(DType::F32).unwrap().to_vec2().unwrap()
    }
    /// The greedy prompt and the 12 tokens transformers generated after it (no EOS stop).
    pub fn greedy(&self) -> (Vec<u32>, Vec<u32>) {
        let ids =
            |name: &str| -> Vec<u32> { self.get(name).to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect() };
        (ids("greedy_prompt"), ids("greedy_tokens"))
    }
    /// The padded batch: ids, positions (pads at 0), mask, next-token targets, valid, weights.
    pub fn batch(&self) -> Batch {
        let ids = self.i64_2d("input_ids");
        let mask = self.i64_2d("attention_mask");
        let pos = self.i64_2d("position_ids");
        let ids_u: Vec<Vec<u32>> = ids.iter().map(|r| r.iter().map(|&x| x as u32).collect()).collect();
        let targets = ids_u.iter().map(|r| r[1..].iter().copied().chain([0]).collect()).collect();
        Batch {
            ids: ids_u,
            positions: pos.iter().map(|r| r.iter().map(|&x| x.max(0) as u32).collect()).collect(),
            mask: mask.iter().map(|r| r.iter().map(|&x| x as u8).collect()).collect(),
            targets,
            valid: self.f32_2d("valid"),
            weights: self.f32_2d("weights"),
        }
    }
}

pub struct Batch {
    pub ids: Vec<Vec<u32>>,
    pub positions: Vec<Vec<u32>>,
    pub mask: Vec<Vec<u8>>,
    pub targets: Vec<Vec<u32>>,
    pub valid: Vec<Vec<f32>>,
    pub weights: Vec<Vec<f32>>,
}

/// Deterministic pseudo-random values in [-1, 1) (an LCG: the same in every test and build).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    (a - b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// ‖a − b‖ / ‖b‖
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let num = (a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    let den = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    num / den.max(1e-30)
}

/// Masks `t` [B, T] with `valid` (where not valid: 0).
pub fn masked(t: &Tensor, valid: &[Vec<f32>]) -> Tensor {
    let v = Tensor::new(valid.to_vec().concat(), &Device::Cpu).unwrap().reshape(t.dims()).unwrap();
    (t.to_dtype(DType::F32).unwrap() * v).unwrap()
}

/// A loss parsed from its name and JSON config (as the edges do).
pub fn loss(name: &str, config: &serde_json::Value) -> oxrl::algo::Loss {
    oxrl::algo::Loss::parse(name, config).unwrap()
}

/// A random one-layer qwen3 with the byte-level tokenizer (ChatML template) written to `dir`:
/// `hidden` wide (heads of 16), `max_position` positions.
pub fn tiny_byte_model(dir: &std::path::Path, hidden: usize, max_position: usize, seed: u64) {
    let shape = oxrl::model::model_config::ModelShape {
        vocab_size: oxrl::model::tokenizer::BYTE_LEVEL_VOCAB_SIZE,
        hidden_size: hidden,
        intermediate_size: 2 * hidden,
        num_layers: 1,
        num_heads: hidden / 16,
        num_kv_heads: 1,
        head_dim: 16,
        rope_theta: 10000.0,
        max_position_embeddings: max_position,
        tie_word_embeddings: false,
    };
    oxrl::model::init::write_random_model(dir, oxrl::model::model_config::Arch::Qwen3, &shape, seed, DType::F32)
        .unwrap();
}

/// `--set`s of a small GRPO run on a tiny byte model at `model`: `steps` steps of 4 groups of 4
/// (6-token replies to synthetic sums), 2 mini-batches, evaluated every step on 3 prompts, with
/// an entropy bonus (so every step changes the policy even without reward) and learning rate `lr`.
pub fn tiny_grpo_sets(model: &std::path::Path, steps: usize, lr: f64) -> Vec<String> {
    vec![
        format!("model.path={}", model.display()),
        "data.synthetic_train=16".into(),
        "data.synthetic_eval=3".into(),
        "rollout.n_samples=4".into(),
        "rollout.eval_samples=2".into(),
        "env.max_turn_tokens=6".into(),
        "train.prompts_per_step=4".into(),
        format!("train.max_steps={steps}"),
        "train.mini_batches=2".into(),
        "train.eval_every=1".into(),
        "algorithm.loss_config={ ent_coef = 0.05 }".into(),
        format!("optimizer.lr={lr}"),
    ]
}

/// `oxrl --threads 1`, the binary under test.
pub fn oxrl_command() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"));
    c.arg("--threads").arg("1");
    c
}

/// The largest difference between the same-named tensors of two safetensors files (which must
/// hold the same names).
pub fn file_max_diff(a: &std::path::Path, b: &std::path::Path) -> f32 {
    let tensors = |path: &std::path::Path| -> Vec<(String, Vec<f32>)> {
        let mut v: Vec<(String, Vec<f32>)> = candle_core::safetensors::load(path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.iter().map(|t| &t.0).collect::<Vec<_>>(), b.iter().map(|t| &t.0).collect::<Vec<_>>());
    a.iter().zip(&b).flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

/// `mpirun -np N oxrl --threads 1 COMMAND --config CONFIG [--set S]…` in the config's folder,
/// as root in a container on few cores (the settings README's "Many machines" names).
pub fn mpirun(np: usize, command: &str, config: &std::path::Path, sets: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new("mpirun");
    c.args(["-np", &np.to_string(), "--oversubscribe", "--bind-to", "none"])
        .envs([
            ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
            ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
            ("OMPI_MCA_btl_vader_single_copy_mechanism", "none"),
        ])
        .current_dir(config.parent().unwrap())
        .arg(env!("CARGO_BIN_EXE_oxrl"))
        .args(["--threads", "1", command, "--config"])
        .arg(config);
    for s in sets {
        c.args(["--set", s]);
    }
    c
}

/// A step drawn at random (from the clock) in `1..=max`.
pub fn random_step(max: usize) -> usize {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    1 + nanos as usize % max
}

/// Runs `oxrl rl --config CONFIG` and SIGKILLs it as soon as `checkpoint` exists (anywhere in the
/// next step), or when 120 s have passed.
pub fn rl_killed_after(config: &std::path::Path, checkpoint: &std::path::Path) {
    let mut child = oxrl_command().args(["rl", "--config"]).arg(config).spawn().unwrap();
    let start = std::time::Instant::now();
    while !checkpoint.exists() && start.elapsed() < std::time::Duration::from_secs(120) {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// A tensor of `t`'s shape and dtype with `values(seed)` scaled by `scale`.
pub fn random_like(t: &Tensor, seed: u64, scale: f64) -> Tensor {
    let v: Vec<f64> = values(t.elem_count(), seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap().to_dtype(t.dtype()).unwrap()
}

/// A fixture model with its trainable variables: every base weight (`lora_rank` 0), or LoRA
/// adapters on every projection including lm_head (B random, so that every adapter tensor gets a
/// non-zero gradient).
pub fn trainable(arch: &str, dtype: DType, lora_rank: usize) -> (oxrl::model::Transformer, Vec<(String, Var)>) {
    use oxrl::model::lora::{self, LoraConfig};
    let mut m = oxrl::model::Transformer::load(&fixture_dir(arch), dtype, &Device::Cpu).unwrap();
    let vars = if lora_rank == 0 {
        m.make_trainable().unwrap()
    } else {
        let cfg = LoraConfig::new(lora_rank, 2.0 * lora_rank as f64, &["all-linear", "lm_head"]);
        let vars = lora::attach_new(&mut m, &cfg, 7).unwrap();
        for (i, (name, v)) in vars.iter().enumerate() {
            if name.contains("lora_B") {
                v.set(&random_like(v.as_tensor(), 100 + i as u64, 0.05)).unwrap();
            }
        }
        vars
    };
    (m, vars)
}

/// `oxrl serve` as a child process of the test, killed (and reaped) on drop.
pub struct ServeProcess {
    pub child: std::process::Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServeProcess {
    /// `oxrl serve` of a tiny byte-level model (`hidden` wide, `positions` long, `seed`; made in
    /// `dir/tiny` unless it is there) for the API keys `keys`, with extra `flags` and environment
    /// `env`, its stderr in `dir/server.log`; returns once `healthz` answers.
    pub fn start(
        dir: &std::path::Path,
        (hidden, positions, seed): (usize, usize, u64),
        keys: &[&str],
        flags: &[&str],
        env: &[(&str, &str)],
    ) -> ServeProcess {
        let model = dir.join("tiny");
        if !model.exists() {
            tiny_byte_model(&model, hidden, positions, seed);
        }
        std::fs::write(dir.join("keys"), format!("{}\n", keys.join("\n"))).unwrap();
        let log = dir.join("server.log");
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = oxrl_command()
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(["--port", &port.to_string(), "--data-dir"])
            .arg(dir.join("data"))
            .arg("--api-keys")
            .arg(dir.join("keys"))
            .args(flags)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .envs(env.iter().copied())
            .spawn()
            .unwrap();
        let mut server = ServeProcess { child, port, log };
        let start = std::time::Instant::now();
        while !server.healthy() {
            assert!(server.child.try_wait().unwrap().is_none(), "the server exited: {}", server.log_text());
            assert!(start.elapsed() < std::time::Duration::from_secs(60), "the server did not come up");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        server
    }

    /// Whether `GET /api/v1/healthz` answers 200 within 5 s.
    pub fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let timeout = std::time::Duration::from_secs(5);
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, timeout) else { return false };
        let _ = s.set_read_timeout(Some(timeout));
        let request =
            format!("GET /api/v1/healthz HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n", self.port);
        let mut answer = String::new();
        s.write_all(request.as_bytes()).is_ok()
            && s.read_to_string(&mut answer).is_ok()
            && answer.starts_with("HTTP/1.1 200")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The real (unpadded) positions of the golden batch, flattened over [B, T], and their targets.
pub fn real_rows(b: &Batch) -> (Vec<u32>, Vec<u32>) {
    let t = b.ids[0].len();
    let mut rows = vec![];
    let mut targets = vec![];
    for (r, valid) in b.valid.iter().enumerate() {
        for (i, &v) in valid.iter().enumerate() {
            if v != 0.0 {
                rows.push((r * t + i) as u32);
                targets.push(b.targets[r][i]);
            }
        }
    }
    (rows, targets)
}

/// Each POST of `calls` (path, body) to the server at `url` (`http://host:port`), its body sent
/// 200 ms after its headers (as a client that writes them apart may send it), is answered, and a
/// GET of `probe` on the same connection then answers 200: a call answered before its body was
/// read had its connection closed by hyper, and a client's next call on that pooled connection
/// found the server gone. `headers`: lines each ending in CRLF.
pub fn late_bodies_keep_the_connection(url: &str, headers: &str, calls: &[(&str, &[u8])], probe: &str) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(url.trim_start_matches("http://")).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    // One answer: its status line, the head read up to the blank line and Content-Length bytes
    // of body after it.
    let answer = |stream: &mut std::net::TcpStream| -> String {
        let mut bytes = vec![];
        let mut byte = [0u8];
        while !bytes.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte) {
                Ok(1) => bytes.push(byte[0]),
                other => {
                    return format!("the connection ended ({other:?}) after {:?}", String::from_utf8_lossy(&bytes))
                }
            }
        }
        let head = String::from_utf8_lossy(&bytes).to_lowercase();
        let length: usize =
            head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).unwrap();
        head.lines().next().unwrap().to_string()
    };
    for (path, body) in calls {
        let head = format!("POST {path} HTTP/1.1\r\nhost: server\r\n{headers}content-length: {}\r\n\r\n", body.len());
        stream.write_all(head.as_bytes()).unwrap();
        stream.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        stream.write_all(body).unwrap();
        let status = answer(&mut stream);
        assert!(status.starts_with("http/1.1 "), "{path}: {status}");
        let get = format!("GET {probe} HTTP/1.1\r\nhost: server\r\n{headers}\r\n");
        if let Err(e) = stream.write_all(get.as_bytes()) {
            panic!("the call after {path}: its connection was closed ({e})");
        }
        let status = answer(&mut stream);
        assert_eq!(status, "http/1.1 200 ok", "the call after {path} on its connection");
    }
}
