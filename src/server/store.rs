//! [`Store`]: the server's durable records in SQLite (`<data-dir>/server.sqlite`): sessions,
//! training models, futures (status and result) and checkpoint metadata. Checkpoints themselves
//! are files under the data dir; this is their registry.
//!
//! Writes are small and synchronous under one connection (WAL mode). On open, a future still
//! `pending` belongs to a server that died: it is marked failed with a clear error, so that a
//! client polling it after a restart gets an answer instead of hanging.

use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension};

use super::checkpoints::CheckpointRef;
use super::errors::{ApiError, ApiResult, Category};
use crate::locks::lock;

pub struct Store {
    conn: Mutex<Connection>,
}

/// A finished future as stored: a JSON result, a protobuf result (with its JSON twin for
/// clients that do not accept protobuf), or an error.
#[derive(Clone, Debug)]
pub enum StoredOutcome {
    Json(String),
    Proto { proto: Vec<u8>, json: String },
    Error { message: String, category: Category },
}

/// A checkpoint's registry entry.
#[derive(Clone, Debug)]
pub struct CheckpointRow {
    pub path: String,
    pub created: f64,
    pub session_id: String,
    pub base_model: String,
    /// The LoRA config as JSON (`LoraConfigWire`).
    pub lora_config: String,
    /// Readable (loadable, samplable) with any API key.
    pub public: bool,
    /// Unix time after which it is gone (TTL); None = kept.
    pub expires_at: Option<f64>,
}

/// A training model's registry entry.
#[derive(Clone, Debug)]
pub struct ModelRow {
    pub id: String,
    pub session_id: String,
    pub base_model: String,
    /// The LoRA config as JSON (`LoraConfigWire`).
    pub lora_config: String,
    /// What the client gave `create_model` as `user_metadata` (JSON; empty if none).
    pub user_metadata: String,
    pub created: f64,
}

/// The layout of the tables below (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 3;

pub const RESTART_ERROR: &str =
    "the server restarted while this request was pending; its result is lost (submit it again)";

pub fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// A [`CheckpointRow`] from the columns `path, created, session_id, base_model, lora_config,
/// public, expires_at` starting at column `first`.
fn checkpoint_row(r: &rusqlite::Row, first: usize) -> rusqlite::Result<CheckpointRow> {
    Ok(CheckpointRow {
        path: r.get(first)?,
        created: r.get(first + 1)?,
        session_id: r.get(first + 2)?,
        base_model: r.get(first + 3)?,
        lora_config: r.get(first + 4)?,
        public: r.get::<_, Option<bool>>(first + 5)?.unwrap_or(false),
        expires_at: r.get(first + 6)?,
    })
}

/// Runs a database call: on a worker of a multi-threaded tokio runtime the worker is handed
/// over for the call ([`tokio::task::block_in_place`]), so a slow query never stalls the HTTP
/// loop; elsewhere (blocking threads, tests, start-up) it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Store {
    pub fn open(path: &Path) -> ApiResult<Store> {
        let conn = Connection::open(path).map_err(|e| ApiError::server(format!("{}: {e}", path.display())))?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version == 1 {
            // Version 2 added checkpoint publishing and TTLs.
            conn.execute_batch(
                "ALTER TABLE checkpoints ADD COLUMN public INTEGER DEFAULT 0;
                 ALTER TABLE checkpoints ADD COLUMN expires_at REAL;",
            )?;
        }
        if version == 1 || version == 2 {
            // Version 3 records the API key that created each future (only it may read or cancel
            // it); a database without the table gets it whole below.
            let has_futures: i64 = conn.query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'futures'",
                [],
                |r| r.get(0),
            )?;
            if has_futures > 0 {
                conn.execute_batch("ALTER TABLE futures ADD COLUMN api_key TEXT;")?;
            }
        } else if version != 0 && version != SCHEMA_VERSION {
            return Err(ApiError::server(format!(
                "{}: database schema version {version}, this server knows {SCHEMA_VERSION}",
                path.display()
            )));
        }
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = NORMAL;
             CREATE TABLE IF NOT EXISTS sessions (
                 id TEXT PRIMARY KEY, api_key TEXT, tags TEXT, user_metadata TEXT,
                 sdk_version TEXT, created REAL, last_heartbeat REAL, finished INTEGER DEFAULT 0);
             CREATE TABLE IF NOT EXISTS models (
                 id TEXT PRIMARY KEY, session_id TEXT, base_model TEXT, lora_config TEXT,
                 user_metadata TEXT, created REAL);
             CREATE TABLE IF NOT EXISTS futures (
                 id TEXT PRIMARY KEY, model_id TEXT, kind TEXT, status TEXT, json TEXT, proto BLOB,
                 error TEXT, category TEXT, created REAL, finished REAL, api_key TEXT);
             CREATE TABLE IF NOT EXISTS checkpoints (
                 run_id TEXT, kind TEXT, name TEXT, path TEXT, created REAL, session_id TEXT,
                 base_model TEXT, lora_config TEXT, public INTEGER DEFAULT 0, expires_at REAL,
                 PRIMARY KEY (run_id, kind, name));",
        )?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        conn.execute(
            "UPDATE futures SET status = 'failed', error = ?1, category = 'server', finished = ?2
             WHERE status = 'pending'",
            params![RESTART_ERROR, now()],
        )?;
        Ok(Store { conn: Mutex::new(conn) })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        lock(&self.conn)
    }

    pub fn add_session(
        &self,
        id: &str,
        api_key: Option<&str>,
        tags: &str,
        user_metadata: &str,
        sdk_version: Option<&str>,
    ) -> ApiResult<()> {
        blocking(|| {
            let t = now();
            self.conn().execute(
                "INSERT INTO sessions (id, api_key, tags, user_metadata, sdk_version, created, last_heartbeat)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)",
                params![id, api_key, tags, user_metadata, sdk_version, t],
            )?;
            Ok(())
        })
    }

    /// The API key that created session `id` (`Some(None)`: created without one); `None` if
    /// there is no such session.
    pub fn session_key(&self, id: &str) -> ApiResult<Option<Option<String>>> {
        blocking(|| {
            Ok(self
                .conn()
                .query_row("SELECT api_key FROM sessions WHERE id = ?1", params![id], |r| r.get::<_, Option<String>>(0))
                .optional()?)
        })
    }

    /// Every session, oldest first: (id, its API key, its user metadata as JSON).
    pub fn sessions(&self) -> ApiResult<Vec<(String, Option<String>, String)>> {
        blocking(|| {
            let conn = self.conn();
            let mut stmt = conn.prepare("SELECT id, api_key, user_metadata FROM sessions ORDER BY created, id")?;
            let rows =
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, Option<String>>(2)?.unwrap_or_default())))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    pub fn heartbeat(&self, id: &str) -> ApiResult<bool> {
        blocking(|| {
            let n = self.conn().execute("UPDATE sessions SET last_heartbeat = ?1 WHERE id = ?2", params![now(), id])?;
            Ok(n == 1)
        })
    }

    /// Whether session `id` has finished (by request or for want of heartbeats).
    pub fn session_finished(&self, id: &str) -> ApiResult<bool> {
        blocking(|| {
            let finished = self
                .conn()
                .query_row("SELECT finished FROM sessions WHERE id = ?1", params![id], |r| r.get::<_, Option<bool>>(0))
                .optional()?;
            Ok(finished.flatten().unwrap_or(false))
        })
    }

    pub fn finish_session(&self, id: &str) -> ApiResult<bool> {
        blocking(|| {
            let n = self.conn().execute("UPDATE sessions SET finished = 1 WHERE id = ?1", params![id])?;
            Ok(n == 1)
        })
    }

    pub fn add_model(
        &self,
        id: &str,
        session_id: &str,
        base_model: &str,
        lora_config: &str,
        user_metadata: &str,
    ) -> ApiResult<()> {
        blocking(|| {
            self.conn().execute(
                "INSERT OR REPLACE INTO models (id, session_id, base_model, lora_config, user_metadata, created)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![id, session_id, base_model, lora_config, user_metadata, now()],
            )?;
            Ok(())
        })
    }

    pub fn add_future(&self, id: &str, model_id: Option<&str>, kind: &str, api_key: Option<&str>) -> ApiResult<()> {
        blocking(|| {
            self.conn().execute(
            "INSERT INTO futures (id, model_id, kind, status, created, api_key) VALUES (?1, ?2, ?3, 'pending', ?4, ?5)",
            params![id, model_id, kind, now(), api_key],
        )?;
            Ok(())
        })
    }

    /// Deletes the futures that finished more than `age_s` seconds ago; returns how many.
    pub fn delete_futures_older_than(&self, age_s: f64) -> ApiResult<usize> {
        blocking(|| {
            let n = self
                .conn()
                .execute("DELETE FROM futures WHERE status != 'pending' AND finished < ?1", params![now() - age_s])?;
            Ok(n)
        })
    }

    /// The API key that created future `id` (`None`: no such future; `Some(None)`: no key).
    pub fn future_key(&self, id: &str) -> ApiResult<Option<Option<String>>> {
        blocking(|| {
            let key = self.conn().query_row("SELECT api_key FROM futures WHERE id = ?1", params![id], |r| r.get(0));
            match key {
                Ok(k) => Ok(Some(k)),
                Err(rusqlite::Error::QueryReturnedNoRows) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
    }

    pub fn finish_future(&self, id: &str, outcome: &StoredOutcome) -> ApiResult<()> {
        blocking(|| {
            let conn = self.conn();
            let t = now();
            match outcome {
                StoredOutcome::Json(json) => conn.execute(
                    "UPDATE futures SET status = 'done', json = ?1, finished = ?2 WHERE id = ?3",
                    params![json, t, id],
                )?,
                StoredOutcome::Proto { proto, json } => conn.execute(
                    "UPDATE futures SET status = 'done', json = ?1, proto = ?2, finished = ?3 WHERE id = ?4",
                    params![json, proto, t, id],
                )?,
                StoredOutcome::Error { message, category } => conn.execute(
                    "UPDATE futures SET status = 'failed', error = ?1, category = ?2, finished = ?3 WHERE id = ?4",
                    params![message, category.as_str(), t, id],
                )?,
            };
            Ok(())
        })
    }

    /// A finished future's outcome; `Ok(None)` while pending; an error if unknown.
    pub fn future(&self, id: &str) -> ApiResult<Option<StoredOutcome>> {
        blocking(|| {
            let row = self
                .conn()
                .query_row("SELECT status, json, proto, error, category FROM futures WHERE id = ?1", params![id], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, Option<String>>(1)?,
                        r.get::<_, Option<Vec<u8>>>(2)?,
                        r.get::<_, Option<String>>(3)?,
                        r.get::<_, Option<String>>(4)?,
                    ))
                })
                .optional()?;
            let (status, json, proto, error, category) =
                row.ok_or_else(|| ApiError::not_found(format!("no request `{id}`")))?;
            Ok(match status.as_str() {
                "pending" => None,
                "failed" => Some(StoredOutcome::Error {
                    message: error.unwrap_or_default(),
                    category: Category::parse(category.as_deref().unwrap_or("server")),
                }),
                _ => match proto {
                    Some(proto) => Some(StoredOutcome::Proto { proto, json: json.unwrap_or_else(|| "{}".into()) }),
                    None => Some(StoredOutcome::Json(json.unwrap_or_else(|| "{}".into()))),
                },
            })
        })
    }

    pub fn add_checkpoint(&self, c: &CheckpointRef, row: &CheckpointRow) -> ApiResult<()> {
        blocking(|| {
            self.conn().execute(
                "INSERT OR REPLACE INTO checkpoints
             (run_id, kind, name, path, created, session_id, base_model, lora_config, public, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                params![
                    c.run_id,
                    c.kind.as_str(),
                    c.name,
                    row.path,
                    row.created,
                    row.session_id,
                    row.base_model,
                    row.lora_config,
                    row.public,
                    row.expires_at
                ],
            )?;
            Ok(())
        })
    }

    pub fn checkpoint(&self, c: &CheckpointRef) -> ApiResult<Option<CheckpointRow>> {
        blocking(|| {
            Ok(self
                .conn()
                .query_row(
                    "SELECT path, created, session_id, base_model, lora_config, public, expires_at FROM checkpoints
                 WHERE run_id = ?1 AND kind = ?2 AND name = ?3 AND (expires_at IS NULL OR expires_at > ?4)",
                    params![c.run_id, c.kind.as_str(), c.name, now()],
                    |r| checkpoint_row(r, 0),
                )
                .optional()?)
        })
    }

    /// Every training model, oldest first.
    pub fn models(&self) -> ApiResult<Vec<ModelRow>> {
        blocking(|| {
            let conn = self.conn();
            let mut stmt = conn.prepare(
            "SELECT id, session_id, base_model, lora_config, created, user_metadata FROM models ORDER BY created, id",
        )?;
            let rows = stmt.query_map([], |r| {
                Ok(ModelRow {
                    id: r.get(0)?,
                    session_id: r.get(1)?,
                    base_model: r.get(2)?,
                    lora_config: r.get(3)?,
                    created: r.get(4)?,
                    user_metadata: r.get::<_, Option<String>>(5)?.unwrap_or_default(),
                })
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// Every checkpoint (of run `run_id` if given), oldest first.
    pub fn checkpoints(&self, run_id: Option<&str>) -> ApiResult<Vec<(CheckpointRef, CheckpointRow)>> {
        blocking(|| {
            let conn = self.conn();
            let mut stmt = conn.prepare(
                "SELECT run_id, kind, name, path, created, session_id, base_model, lora_config, public, expires_at
             FROM checkpoints WHERE (?1 IS NULL OR run_id = ?1) AND (expires_at IS NULL OR expires_at > ?2)
             ORDER BY created, run_id, kind, name",
            )?;
            let rows = stmt.query_map(params![run_id, now()], |r| {
                Ok(((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?), checkpoint_row(r, 3)?))
            })?;
            let mut out = vec![];
            for row in rows {
                let ((run, kind, name), row) = row?;
                out.push((CheckpointRef { run_id: run, kind: super::checkpoints::Kind::parse(&kind)?, name }, row));
            }
            Ok(out)
        })
    }

    pub fn set_checkpoint_public(&self, c: &CheckpointRef, public: bool) -> ApiResult<()> {
        blocking(|| {
            self.conn().execute(
                "UPDATE checkpoints SET public = ?4 WHERE run_id = ?1 AND kind = ?2 AND name = ?3",
                params![c.run_id, c.kind.as_str(), c.name, public],
            )?;
            Ok(())
        })
    }

    pub fn set_checkpoint_expiry(&self, c: &CheckpointRef, expires_at: Option<f64>) -> ApiResult<()> {
        blocking(|| {
            self.conn().execute(
                "UPDATE checkpoints SET expires_at = ?4 WHERE run_id = ?1 AND kind = ?2 AND name = ?3",
                params![c.run_id, c.kind.as_str(), c.name, expires_at],
            )?;
            Ok(())
        })
    }

    /// Checkpoints past their TTL (already invisible), with their directories.
    pub fn expired_checkpoints(&self) -> ApiResult<Vec<(CheckpointRef, String)>> {
        blocking(|| {
            let conn = self.conn();
            let mut stmt = conn.prepare(
                "SELECT run_id, kind, name, path FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?1",
            )?;
            let rows = stmt.query_map(params![now()], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, String>(3)?))
            })?;
            let mut out = vec![];
            for row in rows {
                let (run_id, kind, name, path) = row?;
                out.push((CheckpointRef { run_id, kind: super::checkpoints::Kind::parse(&kind)?, name }, path));
            }
            Ok(out)
        })
    }

    pub fn delete_checkpoint(&self, c: &CheckpointRef) -> ApiResult<bool> {
        blocking(|| {
            let n = self.conn().execute(
                "DELETE FROM checkpoints WHERE run_id = ?1 AND kind = ?2 AND name = ?3",
                params![c.run_id, c.kind.as_str(), c.name],
            )?;
            Ok(n == 1)
        })
    }

    /// Unfinished sessions whose last heartbeat is older than `timeout_s` seconds.
    pub fn stale_sessions(&self, timeout_s: f64) -> ApiResult<Vec<String>> {
        blocking(|| {
            let conn = self.conn();
            let mut stmt = conn.prepare("SELECT id FROM sessions WHERE finished = 0 AND last_heartbeat < ?1")?;
            let rows = stmt.query_map(params![now() - timeout_s], |r| r.get(0))?;
            Ok(rows.collect::<Result<Vec<String>, _>>()?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::checkpoints::Kind;

    /// Database calls run wherever the server makes them: outside a runtime, on a worker of a
    /// multi-threaded one (handed over), on its blocking threads, and on a current-thread
    /// runtime (where `block_in_place` would panic).
    #[test]
    fn database_calls_run_in_every_context() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(Store::open(&dir.path().join("s.sqlite")).unwrap());
        let call = |s: &Store, id: &str| {
            s.add_future(id, None, "sample", Some("k")).unwrap();
            assert_eq!(s.future_key(id).unwrap(), Some(Some("k".to_string())));
        };
        call(&store, "plain");
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        let st = store.clone();
        multi.block_on(async move {
            let s2 = st.clone();
            tokio::spawn(async move { call(&s2, "worker") }).await.unwrap();
            let s3 = st.clone();
            tokio::task::spawn_blocking(move || call(&s3, "blocking")).await.unwrap();
        });
        let single = tokio::runtime::Builder::new_current_thread().build().unwrap();
        single.block_on(async { call(&store, "current") });
    }

    /// A version-1 database (before publishing and TTLs) opens, gains the columns, and keeps its
    /// checkpoints.
    #[test]
    fn version_1_databases_are_upgraded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE checkpoints (
                     run_id TEXT, kind TEXT, name TEXT, path TEXT, created REAL, session_id TEXT,
                     base_model TEXT, lora_config TEXT, PRIMARY KEY (run_id, kind, name));
                 INSERT INTO checkpoints VALUES ('r', 'weights', 'old', '/x', 1.0, 's', 'tiny', '{}');
                 PRAGMA user_version = 1;",
            )
            .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let old = CheckpointRef::new("r", Kind::Weights, "old").unwrap();
        let row = store.checkpoint(&old).unwrap().expect("kept");
        assert_eq!((row.public, row.expires_at, row.path.as_str()), (false, None, "/x"));
        store.set_checkpoint_public(&old, true).unwrap();
        store.set_checkpoint_expiry(&old, Some(now() - 1.0)).unwrap();
        assert!(store.checkpoint(&old).unwrap().is_none(), "expired: invisible");
        assert_eq!(store.expired_checkpoints().unwrap().len(), 1);
        drop(store);
        let version: i64 = Connection::open(&path).unwrap().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }
}
