//! Variable-length integers and a bounds-checked cursor: the primitives of the recording
//! format. Decoding never panics; running off the end is an error.
use super::FormatError;

pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

pub fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

pub fn put_signed(out: &mut Vec<u8>, v: i64) {
    put_varint(out, zigzag(v));
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A chunk payload made of streams, and where each stream ends in it (the writer ends a
/// deflate block there, so each stream gets codes of its own).
#[derive(Debug, Default)]
pub struct Streams {
    pub bytes: Vec<u8>,
    pub ends: Vec<usize>,
}

impl Streams {
    /// `head`, the lengths of `streams` (varints), then the streams, which are emptied.
    pub fn join(head: &[u8], streams: &mut [Vec<u8>]) -> Self {
        let mut bytes = Vec::with_capacity(head.len() + streams.iter().map(|s| s.len() + 4).sum::<usize>());
        bytes.extend_from_slice(head);
        for s in streams.iter() {
            put_varint(&mut bytes, s.len() as u64);
        }
        let mut ends = Vec::with_capacity(streams.len());
        for s in streams.iter_mut() {
            bytes.append(s);
            ends.push(bytes.len());
        }
        Self { bytes, ends }
    }
}

/// Reads from a chunk's payload; `base` is the payload's offset in the file, for errors.
pub struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    base: u64,
}

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8], base: u64) -> Self {
        Self { data, pos: 0, base }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        &self.data[self.pos.min(self.data.len())..]
    }

    fn corrupt(&self, what: &str) -> FormatError {
        FormatError::Corrupt { offset: self.base + self.pos as u64, reason: what.to_string() }
    }

    /// A corruption found at the cursor's position.
    pub fn error(&self, what: &str) -> FormatError {
        self.corrupt(what)
    }

    pub fn u8(&mut self) -> Result<u8, FormatError> {
        let b = *self.data.get(self.pos).ok_or_else(|| self.corrupt("chunk ends inside a value"))?;
        self.pos += 1;
        Ok(b)
    }

    pub fn u64_le(&mut self) -> Result<u64, FormatError> {
        let bytes = self.take(8)?;
        Ok(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
    }

    pub fn u32_le(&mut self) -> Result<u32, FormatError> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
    }

    pub fn varint(&mut self) -> Result<u64, FormatError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                if shift == 63 && b > 1 {
                    return Err(self.corrupt("varint overflows 64 bits"));
                }
                return Ok(v);
            }
        }
        Err(self.corrupt("varint longer than 10 bytes"))
    }

    pub fn varint_u32(&mut self) -> Result<u32, FormatError> {
        let v = self.varint()?;
        u32::try_from(v).map_err(|_| self.corrupt("value does not fit 32 bits"))
    }

    pub fn signed(&mut self) -> Result<i64, FormatError> {
        Ok(unzigzag(self.varint()?))
    }

    /// A length that must not exceed what is left, so corrupt lengths cannot allocate.
    pub fn len(&mut self, item_size: usize) -> Result<usize, FormatError> {
        let n = self.varint()?;
        let left = (self.data.len() - self.pos) as u64;
        if n.saturating_mul(item_size.max(1) as u64) > left {
            return Err(self.corrupt("length exceeds the chunk"));
        }
        Ok(n as usize)
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| self.corrupt("chunk ends inside a value"))?;
        let slice = &self.data[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], FormatError> {
        let n = self.len(1)?;
        self.take(n)
    }

    pub fn string(&mut self) -> Result<String, FormatError> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }

    /// The `N` streams of the rest of a payload [`Streams::join`] made: their lengths
    /// (varints), then the streams, which must end the payload.
    pub fn streams<const N: usize>(self) -> Result<[Cursor<'a>; N], FormatError> {
        self.first_streams(N)
    }

    /// As [`Cursor::streams`] for a payload of `count` streams (at most `N`: a layout
    /// with fewer streams than its successor's); the streams past them are empty.
    pub fn first_streams<const N: usize>(mut self, count: usize) -> Result<[Cursor<'a>; N], FormatError> {
        let mut lens = [0usize; N];
        for len in lens.iter_mut().take(count) {
            *len = self.len(1)?;
        }
        let mut streams: [Cursor<'a>; N] = std::array::from_fn(|_| Cursor::new(&[], self.base));
        for (stream, &len) in streams.iter_mut().zip(&lens) {
            *stream = Cursor::new(self.take(len)?, self.base);
        }
        if !self.is_empty() {
            return Err(self.error("bytes after the last stream"));
        }
        Ok(streams)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn varints_round_trip(values in proptest::collection::vec(any::<u64>(), 0..50), signed in any::<i64>()) {
            let mut out = Vec::new();
            for &v in &values {
                put_varint(&mut out, v);
            }
            put_signed(&mut out, signed);
            let mut c = Cursor::new(&out, 0);
            for &v in &values {
                prop_assert_eq!(c.varint().unwrap(), v);
            }
            prop_assert_eq!(c.signed().unwrap(), signed);
            prop_assert!(c.is_empty());
        }

        #[test]
        fn decoding_garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut c = Cursor::new(&data, 0);
            while !c.is_empty() {
                if c.varint().is_err() || c.string().is_err() {
                    break;
                }
            }
        }
    }

    #[test]
    fn overlong_and_truncated_varints_are_errors() {
        assert!(Cursor::new(&[0xff; 11], 0).varint().is_err());
        assert!(Cursor::new(&[0x80], 0).varint().is_err());
        assert!(Cursor::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02], 0).varint().is_err());
        assert_eq!(
            Cursor::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], 0).varint().unwrap(),
            u64::MAX
        );
    }

    #[test]
    fn a_length_beyond_the_chunk_is_an_error_not_an_allocation() {
        let mut out = Vec::new();
        put_varint(&mut out, u64::MAX / 2);
        assert!(Cursor::new(&out, 0).bytes().is_err());
    }
}
