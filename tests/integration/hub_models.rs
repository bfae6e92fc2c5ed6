//! Models by Hugging Face Hub id, against a local server speaking the Hub's file API (the
//! requests `hf-hub` makes: the repo listing `GET /api/models/{repo}/revision/{rev}` and ranged
//! `GET /{repo}/resolve/{rev}/{file}` with `x-repo-commit`, `etag` / `x-linked-etag` and
//! `Content-Range`), started here: no network. `oxrl` runs as a child process with `HF_HOME` and
//! `HF_ENDPOINT` of its own, as the environment is the process's.
//!
//! Shown: a repo id downloads into the cache and scores, and trains, as the local directory does,
//! bit for bit; a second resolution downloads nothing, and works with the server gone; a pinned
//! revision (tag or commit) resolves that commit; a sharded checkpoint fetches its index and
//! shards; `HF_HUB_OFFLINE=1` reads the cache alone and names what it lacks; a missing repo,
//! revision or file is an error naming it; `HF_TOKEN` is sent.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

const REPO: &str = "oxrl-test/tiny-qwen3";
const MAIN: &str = "1111111111111111111111111111111111111111";
const V0: &str = "2222222222222222222222222222222222222222";
const SHARDED: &str = "3333333333333333333333333333333333333333";
const TOKEN: &str = "hf_test_token";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name)
}

/// The files of a directory (not its subdirectories), by name.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            out.insert(e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap());
        }
    }
    out
}

/// The qwen3 fixture with its weights in two shards and an index instead of one file.
fn sharded_qwen3() -> BTreeMap<String, Vec<u8>> {
    let mut files = files_of(&fixture("qwen3"));
    files.remove("model.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let tensors =
        candle_core::safetensors::load(fixture("qwen3").join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let shard = format!("model-{:05}-of-00002.safetensors", i + 1);
        let map: std::collections::HashMap<String, candle_core::Tensor> =
            part.iter().map(|n| ((*n).clone(), tensors[*n].clone())).collect();
        candle_core::safetensors::save(&map, dir.path().join(&shard)).unwrap();
        files.insert(shard.clone(), std::fs::read(dir.path().join(&shard)).unwrap());
        for n in part {
            weight_map.insert((*n).clone(), shard.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    files.insert("model.safetensors.index.json".into(), index.to_string().into_bytes());
    files
}

/// One repo of the fake Hub: commits by id, refs (branches, tags) to commits, files listed but
/// not served, and whether it needs the token.
#[derive(Default)]
struct FakeRepo {
    commits: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    refs: BTreeMap<String, String>,
    unserved: Vec<String>,
    private: bool,
}

struct FakeHub {
    url: String,
    stop: Arc<AtomicBool>,
    /// Every request line, in order.
    log: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeHub {
    fn start(repos: BTreeMap<String, FakeRepo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(vec![]));
        let (s, l) = (stop.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    serve(conn, &repos, &l);
                }
            }
        });
        FakeHub { url, stop, log, thread: Some(thread) }
    }

    fn requests(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Stops listening: the port refuses connections from here on.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers one request (one per connection: `Connection: close`).
fn serve(conn: TcpStream, repos: &BTreeMap<String, FakeRepo>, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or("").to_string());
    log.lock().unwrap().push(format!("{method} {path}"));
    let authorized = headers.get("authorization").map(String::as_str) == Some(&format!("Bearer {TOKEN}"));
    let reply = answer(&path, headers.get("range").map(String::as_str), authorized, repos);
    let mut conn = conn;
    let (status, extra, body) = reply;
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = conn.write_all(head.as_bytes());
    if method != "HEAD" {
        let _ = conn.write_all(&body);
    }
}

type Reply = (&'static str, Vec<(&'static str, String)>, Vec<u8>);

fn not_found(code: &str) -> Reply {
    ("404 Not Found", vec![("X-Error-Code", code.to_string())], format!("{{\"error\":\"{code}\"}}").into_bytes())
}

fn answer(path: &str, range: Option<&str>, authorized: bool, repos: &BTreeMap<String, FakeRepo>) -> Reply {
    // /api/models/{owner}/{name}/revision/{rev}  or  /{owner}/{name}/resolve/{rev}/{file}
    let p: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (repo_id, rev, file) = match p.as_slice() {
        ["api", "models", o, n, "revision", rev] => (format!("{o}/{n}"), *rev, None),
        [o, n, "resolve", rev, file @ ..] if !file.is_empty() => (format!("{o}/{n}"), *rev, Some(file.join("/"))),
        _ => return not_found("RouteNotFound"),
    };
    let Some(repo) = repos.get(&repo_id) else { return not_found("RepoNotFound") };
    if repo.private && !authorized {
        return ("401 Unauthorized", vec![("X-Error-Code", "RepoNotFound".into())], b"{}".to_vec());
    }
    let commit = repo.refs.get(rev).cloned().unwrap_or_else(|| rev.to_string());
    let Some(files) = repo.commits.get(&commit) else { return not_found("RevisionNotFound") };
    let Some(file) = file else {
        let siblings: Vec<_> = files.keys().map(|f| serde_json::json!({"rfilename": f})).collect();
        let body = serde_json::json!({"id": repo_id, "sha": commit, "siblings": siblings});
        return ("200 OK", vec![("Content-Type", "application/json".into())], body.to_string().into_bytes());
    };
    let Some(bytes) = files.get(&file).filter(|_| !repo.unserved.contains(&file)) else {
        return not_found("EntryNotFound");
    };
    let etag = format!("\"{:x}\"", Sha256::digest(bytes));
    let mut headers = vec![("x-repo-commit", commit.clone()), ("ETag", etag.clone())];
    if file.ends_with(".safetensors") {
        // As the Hub answers for LFS files: the content's hash beside the pointer's.
        headers.push(("x-linked-etag", etag));
    }
    let start: usize = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let end = match range.and_then(|r| r.split('-').nth(1)).and_then(|s| s.parse::<usize>().ok()) {
        Some(e) => e.min(bytes.len() - 1),
        None => bytes.len() - 1,
    };
    headers.push(("Content-Range", format!("bytes {start}-{end}/{}", bytes.len())));
    ("206 Partial Content", headers, bytes[start..=end].to_vec())
}

fn fake_hub() -> FakeHub {
    let mut repos = BTreeMap::new();
    let mut tiny = FakeRepo::default();
    tiny.commits.insert(MAIN.into(), files_of(&fixture("qwen3")));
    tiny.commits.insert(V0.into(), files_of(&fixture("qwen2")));
    tiny.commits.insert(SHARDED.into(), sharded_qwen3());
    tiny.refs.insert("main".into(), MAIN.into());
    tiny.refs.insert("v0".into(), V0.into());
    tiny.refs.insert("sharded".into(), SHARDED.into());
    repos.insert(REPO.to_string(), tiny);
    // Lists its weights but does not serve them.
    let mut broken = FakeRepo { unserved: vec!["model.safetensors".into()], ..Default::default() };
    broken.commits.insert(MAIN.into(), files_of(&fixture("qwen3")));
    broken.refs.insert("main".into(), MAIN.into());
    repos.insert("oxrl-test/broken".into(), broken);
    let mut private = FakeRepo { private: true, ..Default::default() };
    private.commits.insert(MAIN.into(), files_of(&fixture("qwen3")));
    private.refs.insert("main".into(), MAIN.into());
    repos.insert("oxrl-test/private".into(), private);
    FakeHub::start(repos)
}

/// `oxrl ARGS` with the Hub environment: HF_HOME `home`, HF_ENDPOINT `endpoint`, and `env`.
fn oxrl(home: &Path, endpoint: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oxrl"));
    for k in ["HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN_PATH"] {
        c.env_remove(k);
    }
    c.env("HF_HOME", home).env("HF_ENDPOINT", endpoint);
    for (k, v) in env {
        c.env(k, v);
    }
    c.args(["--threads", "1"]).args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "oxrl failed: {stderr}");
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn failed(out: &Output) -> String {
    assert!(!out.status.success(), "oxrl succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn snapshot(home: &Path, commit: &str) -> PathBuf {
    home.join("hub/models--oxrl-test--tiny-qwen3/snapshots").join(commit)
}

const SFT_ROWS: &str = concat!(
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    "\n",
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    "\n",
);

/// The loss of every step of a run's metrics.jsonl.
fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect()
}

#[test]
fn models_by_hub_id_download_cache_pin_and_fail_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, "{\"text\": \"the quick brown fox\"}\n{\"tokens\": [1, 5, 9, 2]}\n").unwrap();
    let input = input.to_str().unwrap();
    let score = |model: &Path| {
        ok(&oxrl(&home, "http://127.0.0.1:9", &[], &["score", "--model", model.to_str().unwrap(), "--input", input]))
    };
    let local_qwen3 = score(&fixture("qwen3"));
    let local_qwen2 = score(&fixture("qwen2"));
    assert_ne!(local_qwen3, local_qwen2);

    let mut hub = fake_hub();
    let url = hub.url.clone();
    let run = |env: &[(&str, &str)], args: &[&str]| oxrl(&home, &url, env, args);

    // Download, then the same bits as the local directory.
    let out = run(&[], &["score", "--model", REPO, "--input", input]);
    assert_eq!(ok(&out), local_qwen3);
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("downloading {REPO} (revision main) from {url}")));
    let snap = snapshot(&home, MAIN);
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
        "model.safetensors",
    ] {
        assert!(snap.join(f).is_file(), "{f} not in the snapshot");
    }
    assert!(!snap.join("golden.safetensors").exists(), "a safetensors file that is not the model's was fetched");
    assert_eq!(std::fs::read_to_string(home.join("hub/models--oxrl-test--tiny-qwen3/refs/main")).unwrap(), MAIN);

    // Again: the listing only, no file is fetched.
    let before = hub.requests().len();
    let out = run(&[], &["score", "--model", REPO, "--input", input]);
    assert_eq!(ok(&out), local_qwen3);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("downloading"));
    let again: Vec<String> = hub.requests()[before..].to_vec();
    assert!(again.iter().all(|r| r.contains("/api/models/")), "{again:?}");

    // A pinned tag, and a pinned commit: that commit's model (the qwen2 fixture).
    assert_eq!(ok(&run(&[], &["score", "--model", REPO, "--revision", "v0", "--input", input])), local_qwen2);
    assert_eq!(ok(&run(&[], &["score", "--model", REPO, "--revision", V0, "--input", input])), local_qwen2);
    // A sharded checkpoint: the index and its shards.
    assert_eq!(ok(&run(&[], &["score", "--model", REPO, "--revision", "sharded", "--input", input])), local_qwen3);
    assert!(snapshot(&home, SHARDED).join("model-00002-of-00002.safetensors").is_file());

    // An SFT run from the id, written in its config file: the local directory's losses, and the
    // saved config names the snapshot.
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, SFT_ROWS).unwrap();
    let sft = |model: &str, name: &str| {
        let cfg = tmp.path().join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "[model]\npath = {model:?}\n[data]\ntrain_file = {:?}\n[train]\nbatch_size = 2\nmicro_batch_size = 1\n\
                 max_steps = 2\neval_every = 0\n[output]\nrun_dir = {name:?}\n",
                data.to_str().unwrap()
            ),
        )
        .unwrap();
        ok(&run(&[], &["sft", "--config", cfg.to_str().unwrap()]));
        tmp.path().join(name)
    };
    let hub_run = sft(REPO, "run_hub");
    let local_run = sft(fixture("qwen3").to_str().unwrap(), "run_local");
    assert_eq!(losses(&hub_run).len(), 2);
    assert_eq!(losses(&hub_run), losses(&local_run));
    let saved: toml::Table = toml::from_str(&std::fs::read_to_string(hub_run.join("config.toml")).unwrap()).unwrap();
    assert_eq!(saved["model"]["path"].as_str(), Some(snap.canonicalize().unwrap().to_str().unwrap()));

    // Missing repo, revision and file: errors naming them (`oxrl rl` resolves its model.path too).
    let rl_cfg = tmp.path().join("rl.toml");
    std::fs::write(&rl_cfg, "[model]\npath = \"oxrl-test/nope\"\n").unwrap();
    let e = failed(&run(&[], &["rl", "--config", rl_cfg.to_str().unwrap()]));
    assert!(e.contains("no such repo") && e.contains("oxrl-test/nope"), "{e}");
    let e = failed(&run(&[], &["score", "--model", "oxrl-test/nope", "--input", input]));
    assert!(e.contains("no such repo") && e.contains("oxrl-test/nope") && e.contains(&url), "{e}");
    let e = failed(&run(&[], &["score", "--model", REPO, "--revision", "v9", "--input", input]));
    assert!(e.contains("no such revision") && e.contains("v9") && e.contains(REPO), "{e}");
    // The benchmarks take --revision too.
    for bench in [
        &["bench", "memory", "--model", REPO, "--revision", "v9"][..],
        &["bench", "decode", "--model", REPO, "--revision", "v9"],
    ] {
        let e = failed(&run(&[], bench));
        assert!(e.contains("no such revision") && e.contains("v9") && e.contains(REPO), "{bench:?}: {e}");
    }
    let e = failed(&run(&[], &["score", "--model", "oxrl-test/broken", "--input", input]));
    assert!(e.contains("no such file model.safetensors") && e.contains("oxrl-test/broken"), "{e}");

    // The token: refused without it, sent with it.
    let e = failed(&run(&[], &["score", "--model", "oxrl-test/private", "--input", input]));
    assert!(e.contains("oxrl-test/private") && e.contains("HF_TOKEN"), "{e}");
    assert_eq!(
        ok(&run(&[("HF_TOKEN", TOKEN)], &["score", "--model", "oxrl-test/private", "--input", input])),
        local_qwen3
    );

    // The server gone: the cache, with a note.
    hub.stop();
    let out = run(&[], &["score", "--model", REPO, "--input", input]);
    assert_eq!(ok(&out), local_qwen3);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be reached"));
    let e = failed(&run(&[], &["score", "--model", "oxrl-test/nope", "--input", input]));
    assert!(e.contains("cannot reach") && e.contains("oxrl-test/nope"), "{e}");

    // Offline: the cache alone, by branch, tag or commit; a miss names repo and revision.
    let offline = [("HF_HUB_OFFLINE", "1")];
    assert_eq!(ok(&run(&offline, &["score", "--model", REPO, "--input", input])), local_qwen3);
    assert_eq!(ok(&run(&offline, &["score", "--model", REPO, "--revision", "v0", "--input", input])), local_qwen2);
    assert_eq!(ok(&run(&offline, &["score", "--model", REPO, "--revision", V0, "--input", input])), local_qwen2);
    let e = failed(&run(&offline, &["score", "--model", REPO, "--revision", "v1", "--input", input]));
    assert!(e.contains("HF_HUB_OFFLINE") && e.contains(REPO) && e.contains("v1"), "{e}");
    // A snapshot that lost a weight file is not taken for complete.
    std::fs::remove_file(snapshot(&home, SHARDED).join("model-00002-of-00002.safetensors")).unwrap();
    let e = failed(&run(&offline, &["score", "--model", REPO, "--revision", "sharded", "--input", input]));
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains(REPO), "{e}");

    // The engine serves a model given by id under that id.
    let mut engine = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .env("HF_HOME", &home)
        .env("HF_HUB_OFFLINE", "1")
        .args(["--threads", "1", "engine", "--model", REPO, "--listen", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(engine.stderr.take().unwrap()).lines();
    let listening = lines.by_ref().map_while(Result::ok).find(|l| l.contains("listening on"));
    engine.kill().unwrap();
    engine.wait().unwrap();
    let listening = listening.expect("the engine did not start");
    assert!(listening.contains(&format!("(model {REPO},")), "{listening}");

    // A local directory of the id's name wins.
    let shadow = tmp.path().join(REPO);
    std::fs::create_dir_all(shadow.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(fixture("qwen2"), &shadow).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .current_dir(tmp.path())
        .env("HF_HOME", &home)
        .env("HF_HUB_OFFLINE", "1")
        .args(["--threads", "1", "score", "--model", REPO, "--input", input])
        .output()
        .unwrap();
    assert_eq!(ok(&out), local_qwen2);
}
