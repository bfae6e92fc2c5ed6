"""tinker-cookbook's `weights.download` against `oxrl serve` (run by run.sh next to it).

    python weights_download.py tinker://RUN/weights/NAME OUT_DIR

Prints one PASS/FAIL line per check (details and tracebacks go to stderr); exits 1 if any fails.
- download of a training checkpoint: the cookbook loads it into a training client, exports it
  with save_weights_external to a fresh age key of its own, downloads, decrypts, deletes;
- save_weights_external without recipients, then download: plain files, the same bytes;
- with two age recipients: every file ends in .age, and each identity decrypts it to the same bytes;
- an invalid recipient is refused.
"""

import hashlib
import sys
import traceback
from pathlib import Path

import pyrage
import tinker
from safetensors.numpy import load_file
from tinker_cookbook import weights

STATE, OUT = sys.argv[1], Path(sys.argv[2])
failed = False


def check(name, fn):
    global failed
    try:
        fn()
        print(f"PASS  weights: {name}", flush=True)
    except Exception as e:
        failed = True
        traceback.print_exc()
        print(f"FAIL  weights: {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def digests(d):
    """relative path -> sha256 of every file under d."""
    d = Path(d)
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def download(path, name):
    return Path(weights.download(tinker_path=path, output_dir=str(OUT / name)))


results = {}


def from_state():
    out = download(STATE, "from_state")
    results["state"] = d = digests(out)
    assert d and not any(k.endswith(".age") for k in d), d
    for p in out.rglob("*.safetensors"):
        assert load_file(str(p)), f"{p} has no tensors"


tc = tinker.ServiceClient().create_training_client_from_state(STATE).result()


def plain():
    d = digests(download(tc.save_weights_external("plain").result().path, "plain"))
    assert d == results["state"], (d, results.get("state"))


def two_recipients():
    ids = [pyrage.x25519.Identity.generate() for _ in range(2)]
    path = tc.save_weights_external("age2", age_encryption_recipients=[str(i.to_public()) for i in ids]).result().path
    out = download(path, "age2")
    assert digests(out) and all(k.endswith(".age") for k in digests(out)), digests(out)
    for n, ident in enumerate(ids):
        dec = OUT / f"age2_decrypted_{n}"
        for f in out.rglob("*.age"):
            dst = dec / f.relative_to(out).with_suffix("")  # drop .age
            dst.parent.mkdir(parents=True, exist_ok=True)
            pyrage.decrypt_file(str(f), str(dst), [ident])
        assert digests(dec) == results["state"], (n, digests(dec))


def invalid_recipient():
    try:
        tc.save_weights_external("bad", age_encryption_recipients=["age1notavalidkey"]).result()
    except tinker.TinkerError as e:
        print("refused as expected:", str(e)[:300], file=sys.stderr)
        return
    raise AssertionError("invalid recipient accepted")


check("download(weights checkpoint), cookbook's own encryption", from_state)
check("save_weights_external, no recipients + download", plain)
check("save_weights_external, 2 age recipients + download + decrypt with each", two_recipients)
check("save_weights_external, invalid recipient refused", invalid_recipient)
sys.exit(1 if failed else 0)
