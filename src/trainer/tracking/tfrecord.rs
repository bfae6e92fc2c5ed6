//! TFRecord framing, the container of TensorBoard event files. Each record is
//!
//! ```text
//! u64 LE   length of the data
//! u32 LE   masked CRC32C of those 8 length bytes
//! [u8]     the data (here one serialised `Event`)
//! u32 LE   masked CRC32C of the data
//! ```
//!
//! CRC32C is the Castagnoli CRC (iSCSI's); TensorFlow stores it masked, rotated right by 15 bits
//! plus 0xa282ead8, because a CRC of data that itself holds CRCs is weak.

use std::io::{self, Write};

/// TensorFlow's mask delta.
const MASK_DELTA: u32 = 0xa282_ead8;

/// The masked CRC32C of `data`, as TFRecord stores it.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Writes `data` as one record (not flushed).
pub fn write_record(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc32c(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc32c(data).to_le_bytes())
}

/// The records of a TFRecord file's bytes, with both checksums of each checked; an error names
/// the record (0-based) and what is wrong. For tests and checks: the trainer only writes.
pub fn read_records(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut records = Vec::new();
    while !bytes.is_empty() {
        let i = records.len();
        let (head, rest) = bytes.split_at_checked(12).ok_or(format!("record {i}: truncated header"))?;
        let (len, crc) = head.split_at(8);
        if masked_crc32c(len) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(format!("record {i}: bad length checksum"));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
        // The data and its 4-byte checksum must both be there.
        let room = rest.len().checked_sub(4);
        let n = usize::try_from(n).ok().filter(|&n| room.is_some_and(|r| n <= r));
        let n = n.ok_or(format!("record {i}: truncated data"))?;
        let (data, rest) = rest.split_at(n);
        let (crc, rest) = rest.split_at(4);
        if masked_crc32c(data) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(format!("record {i}: bad data checksum"));
        }
        records.push(data.to_vec());
        bytes = rest;
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_known_vectors() {
        // The check value of CRC-32C, and RFC 3720's (iSCSI) test patterns.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c::crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c::crc32c(&(0u8..32).collect::<Vec<_>>()), 0x46DD_794E);
        // Masked as TensorFlow does (values from tensorboard's own crc32c).
        assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
        assert_eq!(masked_crc32c(b"abc"), 0x21F1_576E);
    }

    #[test]
    fn a_record_is_framed_and_read_back() {
        let mut out = Vec::new();
        write_record(&mut out, b"abc").unwrap();
        let mut expected = 3u64.to_le_bytes().to_vec();
        expected.extend(0x0E49_99B0u32.to_le_bytes()); // masked CRC32C of the length bytes
        expected.extend(b"abc");
        expected.extend(0x21F1_576Eu32.to_le_bytes());
        assert_eq!(out, expected);

        write_record(&mut out, b"").unwrap();
        assert_eq!(read_records(&out).unwrap(), vec![b"abc".to_vec(), vec![]]);

        let mut bad = out.clone();
        bad[13] ^= 1; // a data byte of the first record
        assert_eq!(read_records(&bad).unwrap_err(), "record 0: bad data checksum");
        bad = out.clone();
        bad[0] = 4;
        assert_eq!(read_records(&bad).unwrap_err(), "record 0: bad length checksum");
        assert_eq!(read_records(&out[..out.len() - 1]).unwrap_err(), "record 1: truncated data");
        assert_eq!(read_records(&out[..20]).unwrap_err(), "record 1: truncated header");
    }
}
