//! Reading a safetensors file one tensor at a time, with plain reads.
//!
//! candle's loader maps the whole file and copies every tensor out of the mapping before it
//! unmaps it: while a model loads, its file's pages and its tensors are both resident, twice the
//! model at the peak of a process that may never need that much again. Here the header is read
//! first (an 8-byte little-endian length, then that many bytes of JSON: for each tensor its
//! dtype, shape and `data_offsets` [begin, end) into the data that follows), then each tensor's
//! bytes are read straight into the tensor's own buffer, so the peak is the tensors alone.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::{DType, Device, Tensor, WithDType};

use crate::{Error, Result};

/// The header's entry for one tensor.
#[derive(serde::Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// Headers larger than this are not safetensors headers (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Every tensor of the file, by name, on `device`. A malformed file is an error saying what is
/// wrong with it (the caller names the file).
pub fn read_tensors(path: &Path, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let bad = |what: String| Error::file(path, format!("not a valid safetensors file: {what}"));
    let mut file = File::open(path).map_err(|e| Error::file(path, e.to_string()))?;
    let file_len = file.metadata().map_err(|e| Error::file(path, e.to_string()))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| bad("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(bad(format!("a header of {n} bytes in a file of {file_len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|e| bad(e.to_string()))?;
    let mut entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("its header is not JSON: {e}")))?;
    entries.remove("__metadata__");
    let data_start = 8 + n;
    let mut out = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        let e: Entry = serde_json::from_value(value).map_err(|err| bad(format!("tensor `{name}`: {err}")))?;
        let dtype = dtype_of(&e.dtype).ok_or_else(|| {
            Error::tensor(path, &name, format!("unsupported dtype {} (expected F32, BF16, F16 or F64)", e.dtype))
        })?;
        let (begin, end) = e.data_offsets;
        let want = e.shape.iter().product::<usize>() as u64 * dtype.size_in_bytes() as u64;
        if end < begin || end - begin != want || data_start + end > file_len {
            return Err(bad(format!(
                "tensor `{name}`: bytes [{begin}, {end}) for shape {:?} of {} in a file of {file_len}",
                e.shape, e.dtype
            )));
        }
        file.seek(SeekFrom::Start(data_start + begin)).map_err(|err| bad(err.to_string()))?;
        let read = |err: std::io::Error| bad(format!("tensor `{name}`: {err}"));
        let count = e.shape.iter().product::<usize>();
        let t = match dtype {
            DType::F64 => read_into::<f64>(&mut file, count, &e.shape).map_err(read)?,
            DType::F32 => read_into::<f32>(&mut file, count, &e.shape).map_err(read)?,
            DType::BF16 => read_into::<half::bf16>(&mut file, count, &e.shape).map_err(read)?,
            _ => read_into::<half::f16>(&mut file, count, &e.shape).map_err(read)?,
        };
        out.push((name, t.to_device(device)?));
    }
    Ok(out)
}

/// The next `count` elements of `file` (little-endian, as safetensors stores them) read straight
/// into the tensor's own buffer: no second copy of the tensor's bytes beside it.
fn read_into<T: WithDType>(file: &mut File, count: usize, shape: &[usize]) -> std::io::Result<Tensor> {
    let mut data = vec![T::from_f64(0.0); count];
    // Safety: T is a float of `size_of::<T>()` bytes, any bit pattern of which is a value; the
    // byte view covers exactly `data`'s elements and ends before `data` is used again. (The
    // bytes land in native order: the little-endian machines candle runs on.)
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), count * std::mem::size_of::<T>()) };
    file.read_exact(bytes)?;
    Tensor::from_vec(data, shape, &Device::Cpu).map_err(std::io::Error::other)
}

fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, tensors: &[(&str, Tensor)]) {
        let named: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        let mut map = std::collections::HashMap::new();
        for (n, t) in &named {
            map.insert(n.clone(), t.clone());
        }
        candle_core::safetensors::save(&map, path).unwrap();
    }

    /// The tensors candle's own loader reads, bit for bit, in every float dtype; a truncated file,
    /// a header past the end and an integer tensor are errors saying so.
    #[test]
    fn reads_what_candle_reads_and_refuses_malformed_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let base = Tensor::arange(0f32, 24., &Device::Cpu).unwrap().affine(0.37, -1.1).unwrap();
        let tensors = [
            ("a", base.reshape((2, 3, 4)).unwrap()),
            ("b", base.to_dtype(DType::BF16).unwrap()),
            ("c", base.reshape((6, 4)).unwrap().to_dtype(DType::F16).unwrap()),
            ("d", base.to_dtype(DType::F64).unwrap()),
            ("e", Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap()),
        ];
        write(&path, &tensors);
        let ours = read_tensors(&path, &Device::Cpu).unwrap();
        let theirs = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert_eq!(ours.len(), theirs.len());
        for (name, t) in &ours {
            let want = &theirs[name];
            assert_eq!((t.dtype(), t.dims()), (want.dtype(), want.dims()), "{name}");
            let bits = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(t), bits(want), "{name}");
        }
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let e = read_tensors(&path, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors file") && e.contains("in a file of"), "{e}");
        let mut long = bytes.clone();
        long[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        std::fs::write(&path, &long).unwrap();
        let e = read_tensors(&path, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("a header of"), "{e}");
        write(&path, &[("ids", Tensor::new(&[1u32, 2], &Device::Cpu).unwrap())]);
        let e = read_tensors(&path, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("ids") && e.contains("unsupported dtype U32"), "{e}");
    }
}
