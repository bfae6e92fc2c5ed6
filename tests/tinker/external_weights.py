"""save_weights_external with age encryption through the official SDK and pyrage (run by
tests/server_sdk.rs), the way tinker-cookbook's `weights.download` does it:

- an x25519 identity; `save_weights_external(name, ttl_seconds, age_encryption_recipients=[pub])`
  returns tinker://RUN/external_weights/NAME;
- `RestClient.get_external_weights_urls` signs one URL per file, every name ending in `.age`,
  `expires` timezone-aware;
- urllib downloads them without an API key (as the cookbook does); pyrage decrypts them to
  exactly the files of an unencrypted export of the same weights (and the safetensors load);
- the TTL can be renewed, and the export deleted: its URLs then fail.
"""

import datetime
import json
import os
import tempfile
import urllib.error
import urllib.request

import numpy as np
import pyrage
import tinker

from common import text_datum, finish

MODEL = os.environ["OXRL_MODEL"]


def read_safetensors(data: bytes) -> dict:
    """name -> float32 array of a safetensors file of F32 tensors (no safetensors package needed)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (name, info["dtype"])
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(body[start:end], dtype=np.float32).reshape(info["shape"])
    return out


def download(urls: dict, out: str) -> dict:
    files = {}
    for name in sorted(urls):
        dst = os.path.join(out, name)
        urllib.request.urlretrieve(urls[name], dst)  # raises on a short body (Content-Length)
        with open(dst, "rb") as f:
            files[name] = f.read()
    return files


def main() -> None:
    service = tinker.ServiceClient()
    rest = service.create_rest_client()
    client = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    batch = [text_datum(b"the cat sat on the mat")]
    client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()

    identity = pyrage.x25519.Identity.generate()
    enc = client.save_weights_external(
        "download", ttl_seconds=3600, age_encryption_recipients=[str(identity.to_public())]
    ).result()
    plain = client.save_weights_external("plain").result()
    run = client.model_id
    assert enc.path == f"tinker://{run}/external_weights/download", enc.path
    assert plain.path == f"tinker://{run}/external_weights/plain", plain.path

    signed = rest.get_external_weights_urls(enc.path).result()
    assert sorted(signed.urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"], signed.urls
    assert signed.expires.tzinfo is not None, signed.expires
    left = signed.expires - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(minutes=30) < left <= datetime.timedelta(hours=1, minutes=1), left
    plain_urls = rest.get_external_weights_urls(plain.path).result().urls
    assert sorted(plain_urls) == ["adapter_config.json", "adapter_model.safetensors"], plain_urls

    with tempfile.TemporaryDirectory() as out:
        encrypted = download(signed.urls, out)
        reference = download(plain_urls, out)
        for name, ciphertext in encrypted.items():
            clear = name[: -len(".age")]
            assert ciphertext != reference[clear], f"{name} is not encrypted"
            assert pyrage.decrypt(ciphertext, [identity]) == reference[clear], f"{name} decrypts to other bytes"
            # The cookbook's way: decrypt_file with an identity parsed from its string.
            dst = os.path.join(out, "decrypted-" + clear)
            pyrage.decrypt_file(os.path.join(out, name), dst, [pyrage.x25519.Identity.from_str(str(identity))])
            with open(dst, "rb") as f:
                assert f.read() == reference[clear]
        other = pyrage.x25519.Identity.generate()
        try:
            pyrage.decrypt(encrypted["adapter_model.safetensors.age"], [other])
            raise AssertionError("decrypted with another identity")
        except pyrage.DecryptError:
            pass
        tensors = read_safetensors(reference["adapter_model.safetensors"])
        assert any(".lora_A." in k for k in tensors) and any(".lora_B." in k for k in tensors), list(tensors)
        assert any(abs(v).max() > 0 for k, v in tensors.items() if ".lora_B." in k), "untrained adapter"
        config = json.loads(reference["adapter_config.json"])
        assert config["r"] == 4 and "lora_alpha" in config, config
    size = sum(len(b) for b in encrypted.values())
    print(f"encrypted export: {len(encrypted)} files, {size} bytes, decrypted == plain export")

    # Listed, TTL renewable, deletable; a deleted export's URLs fail.
    listed = rest.list_checkpoints(run).result().checkpoints
    kinds = {c.tinker_path: c.checkpoint_type for c in listed}
    assert kinds.get(enc.path) == "external", kinds
    rest.set_checkpoint_ttl_from_tinker_path(enc.path, 3600).result()
    rest.delete_checkpoint_from_tinker_path(enc.path).result()
    try:
        urllib.request.urlopen(signed.urls["adapter_config.json.age"])
        raise AssertionError("a deleted export's URL still works")
    except urllib.error.HTTPError as e:
        assert e.code == 404, e.code
    print("ttl renewed, deleted: URLs 404")
    finish()


if __name__ == "__main__":
    main()
