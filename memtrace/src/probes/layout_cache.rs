//! The kernel layout (the structure offsets `btf::Btf` finds for the probes) kept in the
//! unwind cache's directory between runs: reading the kernel's BTF for it is ~30-60 ms of
//! every start. The kernel's own BTF cannot change without a reboot, so an entry is keyed
//! by the boot (`/proc/sys/kernel/random/boot_id`), the kernel release and the size of
//! `/sys/kernel/btf/vmlinux`, and carries a format version and a checksum; it is trusted
//! under the cache's rules (a regular file owned by root or by us, written by no one else).
//! Anything else is recomputed from the BTF, the reason logged at debug level.
use std::{fs, mem::size_of, path::Path};

use memtrace_common::KernelLayout;

use crate::unwind::cache::{DiskCache, Rejected, read_trusted, write_atomically};

const FILE_NAME: &str = "kernel-layout";
const MAGIC: &[u8; 8] = b"MTKLAYT\0";
/// Bumped whenever what the layout holds or how it is found changes.
const VERSION: u32 = 6;

const WORDS: usize = size_of::<KernelLayout>() / 4;
// Every field is a u32: the layout is its words, in order, with no padding.
const _: () = assert!(size_of::<KernelLayout>().is_multiple_of(4) && align_of::<KernelLayout>() == 4);

/// What identifies the running kernel's BTF: the boot, the release, the BTF's size.
pub fn current_key() -> Option<Vec<u8>> {
    let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let btf_len = fs::metadata("/sys/kernel/btf/vmlinux").ok()?.len();
    Some(format!("{} {} {btf_len}", boot.trim(), release.trim()).into_bytes())
}

/// The layout cached in `dir` for `key`, or why there is none to trust.
pub fn load(dir: &Path, key: &[u8]) -> Result<KernelLayout, Rejected> {
    decode(&read_trusted(&dir.join(FILE_NAME))?, key)
}

/// Keeps `layout` in `dir` for `key` (replacing any earlier entry).
pub fn store(dir: &Path, key: &[u8], layout: &KernelLayout) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
    write_atomically(&tmp, &dir.join(FILE_NAME), |out| out.write_all(&encode(key, layout)))
}

/// The layout from the cache when it holds one for this kernel, else `compute`'s (then
/// cached). `use_cache` false (`--no-unwind-cache`) computes it and leaves the cache alone.
pub fn layout_or(
    use_cache: bool,
    compute: impl FnOnce() -> anyhow::Result<KernelLayout>,
) -> anyhow::Result<KernelLayout> {
    let cache = use_cache.then(DiskCache::open_default).flatten();
    let key = cache.as_ref().and_then(|_| current_key());
    let (Some(cache), Some(key)) = (cache, key) else { return compute() };
    match load(cache.dir(), &key) {
        Ok(layout) => return Ok(layout),
        Err(Rejected::Missing) => {}
        Err(why) => log::debug!("kernel layout cache: {why}; read from the BTF again"),
    }
    let layout = compute()?;
    if let Err(e) = store(cache.dir(), &key, &layout) {
        log::debug!("kernel layout cache: storing failed: {e}");
    }
    Ok(layout)
}

fn words_of(layout: &KernelLayout) -> [u32; WORDS] {
    // SAFETY: KernelLayout is repr(C), all u32 fields, no padding (asserted above): its
    // bytes are WORDS u32s.
    unsafe { std::ptr::read(layout as *const KernelLayout as *const [u32; WORDS]) }
}

fn layout_of(words: [u32; WORDS]) -> KernelLayout {
    // SAFETY: as above; any u32 is a valid value of every field.
    unsafe { std::ptr::read(&words as *const [u32; WORDS] as *const KernelLayout) }
}

/// Magic, version, key length, key, word count, words, then the CRC-32 of all before it.
fn encode(key: &[u8], layout: &KernelLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + key.len() + WORDS * 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(WORDS as u32).to_le_bytes());
    for w in words_of(layout) {
        out.extend_from_slice(&w.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn decode(data: &[u8], key: &[u8]) -> Result<KernelLayout, Rejected> {
    let u32_at = |at: usize| -> Result<u32, Rejected> {
        let b = data.get(at..at + 4).ok_or(Rejected::Truncated)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if data.len() < 16 {
        return Err(Rejected::Truncated);
    }
    if &data[..8] != MAGIC {
        return Err(Rejected::BadMagic);
    }
    let version = u32_at(8)?;
    if version != VERSION {
        return Err(Rejected::WrongVersion(version));
    }
    let key_len = u32_at(12)? as usize;
    let words_at = 16usize.checked_add(key_len).ok_or(Rejected::Truncated)?;
    let crc_at = words_at + 4 + WORDS * 4;
    if data.len() != crc_at + 4 {
        return Err(if data.len() < crc_at + 4 { Rejected::Truncated } else { Rejected::Io("trailing bytes".into()) });
    }
    if crc32fast::hash(&data[..crc_at]) != u32_at(crc_at)? {
        return Err(Rejected::Checksum);
    }
    if &data[16..words_at] != key || u32_at(words_at)? as usize != WORDS {
        return Err(Rejected::OtherKey);
    }
    let mut words = [0u32; WORDS];
    for (i, w) in words.iter_mut().enumerate() {
        *w = u32_at(words_at + 4 + i * 4)?;
    }
    Ok(layout_of(words))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KernelLayout {
        let mut words = [0u32; WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            *w = 1000 + i as u32 * 8;
        }
        layout_of(words)
    }

    #[test]
    fn a_layout_round_trips_and_only_for_its_key() {
        let data = encode(b"boot release 123", &sample());
        assert_eq!(decode(&data, b"boot release 123"), Ok(sample()));
        assert_eq!(decode(&data, b"boot release 124"), Err(Rejected::OtherKey));
    }

    #[test]
    fn corrupt_truncated_and_other_versions_are_rejected() {
        let key = b"k";
        let good = encode(key, &sample());
        let mut flipped = good.clone();
        flipped[20] ^= 1;
        assert_eq!(decode(&flipped, key), Err(Rejected::Checksum));
        for len in [0, 7, 15, good.len() - 1] {
            assert!(decode(&good[..len], key).is_err(), "truncated to {len}");
        }
        let mut other = good.clone();
        other[8] = 9;
        assert_eq!(decode(&other, key), Err(Rejected::WrongVersion(9)));
        let mut magic = good;
        magic[0] = b'X';
        assert_eq!(decode(&magic, key), Err(Rejected::BadMagic));
    }

    #[test]
    fn a_stored_entry_is_read_back_and_a_foreign_one_is_not() {
        let tmp = tempfile::Builder::new().prefix("memtrace-layout-test-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        store(&dir, b"key", &sample()).unwrap();
        assert_eq!(load(&dir, b"key"), Ok(sample()));
        assert_eq!(load(&dir, b"other"), Err(Rejected::OtherKey));
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(dir.join(FILE_NAME), fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(load(&dir, b"key"), Err(Rejected::WritableByOthers(_))));
    }

    #[test]
    fn the_running_kernel_has_a_key() {
        // Every kernel memtrace runs on has BTF and a boot id.
        if Path::new("/sys/kernel/btf/vmlinux").exists() {
            let key = current_key().unwrap();
            assert_eq!(current_key().unwrap(), key);
        }
    }
}
