//! `save_weights_external` and its downloads: a model's weights exported for use elsewhere (a
//! LoRA model's PEFT adapter, `adapter_model.safetensors` + `adapter_config.json`), optionally
//! encrypted with [age](https://age-encryption.org) to the client's x25519 or SSH recipients (every file
//! then stored as `NAME.age`), and handed out through signed, expiring URLs that need no API key
//! (the SDK and the cookbook fetch them with plain `urllib`).
//!
//! A URL is `{base}/api/v1/external_weights_files/{run}/{name}/{file}?expires=UNIX&sig=HEX`,
//! `sig` = HMAC-SHA256 over run, name, file and expiry with a secret kept in the data dir (so
//! URLs survive a restart). The signature proves the server handed the URL out; the file is
//! still served only while the checkpoint exists.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::errors::{ApiError, ApiResult};

/// At most this many recipients (the SDK documents 10).
pub const MAX_RECIPIENTS: usize = 10;
/// How long a signed URL works. The clients sign again when under 5 minutes are left, so this
/// must be well above that.
pub const URL_LIFETIME_S: u64 = 3600;
/// The file route's prefix (the API-key check lets it through: the signature is the credential).
pub const FILES_PREFIX: &str = "/api/v1/external_weights_files/";
/// The suffix of an encrypted file.
pub const AGE_SUFFIX: &str = ".age";

const SECRET_FILE: &str = "url_signing.key";

/// One of the request's recipients: an age x25519 key (`age1…`), or an SSH public key
/// (`ssh-ed25519 …`, `ssh-rsa …`), as the SDK documents `age_encryption_recipients`.
pub enum Recipient {
    Age(age::x25519::Recipient),
    Ssh(age::ssh::Recipient),
}

impl Recipient {
    fn parse(s: &str) -> ApiResult<Recipient> {
        let s = s.trim();
        let shown: String = s.chars().take(80).collect();
        let bad = |why: String| {
            ApiError::user(format!(
                "age_encryption_recipients: `{shown}` is not an age x25519 public key (age1…) or an SSH public key \
                 (ssh-ed25519 …, ssh-rsa …): {why}"
            ))
        };
        if s.starts_with("ssh-") {
            return age::ssh::Recipient::from_str(s).map(Recipient::Ssh).map_err(|e| bad(format!("{e:?}")));
        }
        age::x25519::Recipient::from_str(s).map(Recipient::Age).map_err(|e| bad(e.to_string()))
    }

    fn as_age(&self) -> &dyn age::Recipient {
        match self {
            Recipient::Age(r) => r,
            Recipient::Ssh(r) => r,
        }
    }
}

/// Parses the request's recipients ([`Recipient`]), 1 to [`MAX_RECIPIENTS`]. `None` (not
/// given): the export is stored unencrypted.
pub fn parse_recipients(recipients: Option<&[String]>) -> ApiResult<Option<Vec<Recipient>>> {
    let Some(list) = recipients else { return Ok(None) };
    if list.is_empty() {
        // age cannot encrypt to nobody; an empty list is a mistake, not a request for plaintext.
        return Err(ApiError::user(
            "age_encryption_recipients is empty: give 1 to 10 age public keys (age1…) or SSH public keys, or leave \
             it out for an unencrypted export",
        ));
    }
    if list.len() > MAX_RECIPIENTS {
        return Err(ApiError::user(format!(
            "age_encryption_recipients: {} keys given, at most {MAX_RECIPIENTS} allowed",
            list.len()
        )));
    }
    list.iter().map(|s| Recipient::parse(s)).collect::<ApiResult<Vec<_>>>().map(Some)
}

/// Moves the export in `staging` into `dest`, each file encrypted to `recipients` (as
/// `NAME.age`) when given; returns the stored bytes. `dest` appears whole or not at all.
pub fn store_export(staging: &Path, dest: &Path, recipients: Option<&[Recipient]>) -> crate::Result<u64> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(staging)
        .map_err(|e| crate::Error::file(staging, format!("cannot list: {e}")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut size = 0u64;
    crate::files::write_dir_atomically(dest, |tmp| {
        for src in &files {
            let name = src.file_name().unwrap_or_default().to_string_lossy().to_string();
            let dst = match recipients {
                Some(r) => {
                    let dst = tmp.join(format!("{name}{AGE_SUFFIX}"));
                    encrypt_file(src, &dst, r)?;
                    dst
                }
                None => {
                    let dst = tmp.join(&name);
                    std::fs::rename(src, &dst).map_err(|e| crate::Error::file(src, format!("cannot move: {e}")))?;
                    dst
                }
            };
            size += std::fs::metadata(&dst).map(|m| m.len()).unwrap_or(0);
        }
        Ok(())
    })?;
    Ok(size)
}

/// Encrypts `src` to `dst` in age's binary format, streaming (a full model's weights need not
/// fit in memory twice).
fn encrypt_file(src: &Path, dst: &Path, recipients: &[Recipient]) -> crate::Result<()> {
    let err = |e: &dyn std::fmt::Display| crate::Error::file(src, format!("cannot encrypt: {e}"));
    let encryptor = age::Encryptor::with_recipients(recipients.iter().map(Recipient::as_age)).map_err(|e| err(&e))?;
    let out = std::fs::File::create(dst).map_err(|e| crate::Error::file(dst, format!("cannot create: {e}")))?;
    let mut writer = encryptor.wrap_output(std::io::BufWriter::new(out)).map_err(|e| err(&e))?;
    let mut input = std::fs::File::open(src).map_err(|e| crate::Error::file(src, format!("cannot open: {e}")))?;
    std::io::copy(&mut input, &mut writer).map_err(|e| err(&e))?;
    // finish() writes the last chunk; without it the file would not decrypt.
    writer.finish().and_then(|mut w| w.flush()).map_err(|e| err(&e))?;
    Ok(())
}

/// Signs and checks download URLs with the server's secret.
pub struct UrlSigner {
    secret: [u8; 32],
}

impl UrlSigner {
    /// The secret in `data_dir`, created (random, owner-only) on first start.
    pub fn open(data_dir: &Path) -> anyhow::Result<UrlSigner> {
        let path = data_dir.join(SECRET_FILE);
        if !path.exists() {
            let secret: [u8; 32] = rand::random();
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            // create_new: two servers starting at once on one data dir agree on the first file.
            if let Ok(mut f) = options.open(&path) {
                f.write_all(hex(&secret).as_bytes())?;
                f.sync_all()?;
            }
        }
        let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let bytes = unhex(text.trim()).filter(|b| b.len() == 32).ok_or_else(|| {
            anyhow::anyhow!(
                "{}: not 64 hex digits (delete it to make a new one; old URLs stop working)",
                path.display()
            )
        })?;
        let mut secret = [0u8; 32];
        secret.copy_from_slice(&bytes);
        Ok(UrlSigner { secret })
    }

    fn mac(&self, run: &str, name: &str, file: &str, expires: u64) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes keys of any length");
        // Length-prefixed parts: no two (run, name, file) triples sign the same bytes.
        for part in [run, name, file] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part.as_bytes());
        }
        mac.update(&expires.to_le_bytes());
        mac
    }

    pub fn sign(&self, run: &str, name: &str, file: &str, expires: u64) -> String {
        hex(&self.mac(run, name, file, expires).finalize().into_bytes())
    }

    /// Whether `sig` is ours for these parts (compared in constant time).
    pub fn verify(&self, run: &str, name: &str, file: &str, expires: u64, sig: &str) -> bool {
        unhex(sig).is_some_and(|s| self.mac(run, name, file, expires).verify_slice(&s).is_ok())
    }

    /// The signed URL of one file under `base` (scheme and authority, no trailing `/`).
    pub fn url(&self, base: &str, run: &str, name: &str, file: &str, expires: u64) -> String {
        format!(
            "{base}{FILES_PREFIX}{}/{}/{}?expires={expires}&sig={}",
            percent_encode(run),
            percent_encode(name),
            percent_encode(file),
            self.sign(run, name, file, expires)
        )
    }
}

/// `expires` and `sig` from a file URL's query string.
pub fn parse_query(query: Option<&str>) -> Option<(u64, String)> {
    let (mut expires, mut sig) = (None, None);
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("expires", v)) => expires = v.parse().ok(),
            Some(("sig", v)) => sig = Some(v.to_string()),
            _ => {}
        }
    }
    Some((expires?, sig?))
}

/// The URLs' scheme and authority: `--public-url` if set, else `http://` + the request's Host
/// (what the client reached us by). A Host with characters no authority has is refused, so a
/// forged header cannot inject anything into the URLs.
pub fn base_url(public_url: Option<&str>, host: Option<&str>) -> ApiResult<String> {
    if let Some(url) = public_url {
        return Ok(url.trim_end_matches('/').to_string());
    }
    let host =
        host.filter(|h| !h.is_empty()).ok_or_else(|| ApiError::user("no Host header to build download URLs from"))?;
    if !host.chars().all(|c| c.is_ascii_alphanumeric() || ".-_:[]".contains(c)) {
        return Err(ApiError::user("the Host header is not a host[:port]"));
    }
    Ok(format!("http://{host}"))
}

/// Unix seconds as RFC 3339 UTC (`2026-11-24T19:16:53Z`): the clients compare it with an
/// aware datetime, so it must carry its zone.
pub fn rfc3339(unix: u64) -> String {
    let (days, secs) = ((unix / 86_400) as i64, unix % 86_400);
    let (year, month, day) = crate::dates::civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_547_813), "2026-11-24T19:16:53Z");
    }

    #[test]
    fn signatures_bind_every_part_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let s = UrlSigner::open(dir.path()).unwrap();
        let sig = s.sign("s:train:0", "final", "adapter_model.safetensors", 100);
        assert!(s.verify("s:train:0", "final", "adapter_model.safetensors", 100, &sig));
        assert!(!s.verify("s:train:0", "final", "adapter_model.safetensors", 101, &sig));
        assert!(!s.verify("s:train:0", "final", "adapter_config.json", 100, &sig));
        assert!(!s.verify("s:train:0", "finalx", "adapter_model.safetensors", 100, &sig));
        assert!(!s.verify("s:train:0", "final", "adapter_model.safetensors", 100, "zz"));
        let again = UrlSigner::open(dir.path()).unwrap();
        assert!(again.verify("s:train:0", "final", "adapter_model.safetensors", 100, &sig));
        let url = s.url("http://h:1", "s:train:0", "a b", "f", 7);
        assert!(url.starts_with("http://h:1/api/v1/external_weights_files/s%3Atrain%3A0/a%20b/f?expires=7&sig="));
        assert_eq!(parse_query(url.split_once('?').map(|x| x.1)), Some((7, sig_of(&s))));
    }

    fn sig_of(s: &UrlSigner) -> String {
        s.sign("s:train:0", "a b", "f", 7)
    }

    #[test]
    fn url_bases_come_from_the_flag_or_a_plain_host() {
        assert_eq!(base_url(Some("https://t.example.com/"), Some("evil")).unwrap(), "https://t.example.com");
        assert_eq!(base_url(None, Some("127.0.0.1:8000")).unwrap(), "http://127.0.0.1:8000");
        assert_eq!(base_url(None, Some("[::1]:8000")).unwrap(), "http://[::1]:8000");
        for bad in [None, Some(""), Some("a/b"), Some("h@x"), Some("h x")] {
            assert!(base_url(None, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn recipients_are_checked() {
        assert!(parse_recipients(None).unwrap().is_none());
        assert!(parse_recipients(Some(&[])).is_err());
        assert!(parse_recipients(Some(&["ssh-ed25519 AAAA".to_string()])).is_err());
        assert!(parse_recipients(Some(&["ssh-dss AAAAB3NzaC1kc3MAAACBAP".to_string()])).is_err());
        assert!(parse_recipients(Some(&[SSH_PUBLIC.to_string()])).unwrap().is_some());
        let key = age::x25519::Identity::generate().to_public().to_string();
        assert_eq!(parse_recipients(Some(std::slice::from_ref(&key))).unwrap().unwrap().len(), 1);
        assert!(parse_recipients(Some(&vec![key; 11])).is_err());
    }

    /// Exports a staging directory holding `a.json` = `body` to the recipients `keys`; returns
    /// the export's size and the encrypted file's bytes.
    fn export_one(body: &[u8], keys: &[String]) -> (u64, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join("staging");
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join("a.json"), body).unwrap();
        let r = parse_recipients(Some(keys)).unwrap().unwrap();
        let dest = dir.path().join("out");
        let size = store_export(&staging, &dest, Some(&r)).unwrap();
        (size, std::fs::read(dest.join("a.json.age")).unwrap())
    }

    #[test]
    fn encrypted_exports_decrypt() {
        let id = age::x25519::Identity::generate();
        let (size, ct) = export_one(b"{\"r\": 4}", &[id.to_public().to_string()]);
        assert_eq!(size, ct.len() as u64);
        assert_eq!(age::decrypt(&id, &ct).unwrap(), b"{\"r\": 4}");
    }

    /// A throwaway ed25519 key pair made for this test (`ssh-keygen -t ed25519 -N ""`).
    const SSH_PUBLIC: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKgPR3l2Qu2kBIBNKxmg9e3BR/eA2GBIeB4aPeu+dPl7 oxrl-test";
    const SSH_PRIVATE: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACCoD0d5dkLtpASATSsZoPXtwUf3gNhgSHgeGj3rvnT5ewAAAJD4r4Dd+K+A\n3QAAAAtzc2gtZWQyNTUxOQAAACCoD0d5dkLtpASATSsZoPXtwUf3gNhgSHgeGj3rvnT5ew\nAAAEBLom0xcB0DNix9ugpfsj/ixHc/D5ULn9k9xUqFe4eAGagPR3l2Qu2kBIBNKxmg9e3B\nR/eA2GBIeB4aPeu+dPl7AAAACW94cmwtdGVzdAECAwQ=\n-----END OPENSSH PRIVATE KEY-----\n";

    #[test]
    fn ssh_recipients_decrypt_with_the_ssh_key() {
        let age_id = age::x25519::Identity::generate();
        let (_, ct) = export_one(b"{\"r\": 8}", &[SSH_PUBLIC.to_string(), age_id.to_public().to_string()]);
        let ssh_id = age::ssh::Identity::from_buffer(SSH_PRIVATE.as_bytes(), None).unwrap();
        assert_eq!(age::decrypt(&ssh_id, &ct).unwrap(), b"{\"r\": 8}");
        assert_eq!(age::decrypt(&age_id, &ct).unwrap(), b"{\"r\": 8}");
    }
}
