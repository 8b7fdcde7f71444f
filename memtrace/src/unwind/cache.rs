//! The disk cache of built unwind tables (`/var/cache/memtrace/unwind` by default): one file
//! per binary, keyed by its build id (else device, inode, size and modification time), so
//! a second `record` of the same program starts with every table ready. An entry is
//! versioned and checksummed, and trusted only if it is a regular file owned by root (or by
//! memtrace's own user) that no one else may write; anything else — corrupt, truncated,
//! another version, another key, a foreign owner — is rebuilt, never read, with the reason
//! logged at debug level. The cache is bounded in bytes; the least recently used entries go
//! first. Writes go to a temporary file renamed into place, so a crash leaves no half entry.
//!
//! Beside the tables, small lists per program. [`DiskCache::companions`]: the files whose
//! code it ran last time (the libraries it dlopen'd included). When the program starts
//! again their tables are loaded at once, before it maps them, so the probes install each
//! mapping themselves and no stack waits for a table. [`DiskCache::allocator_programs`]:
//! the programs with an allocator of their own a recorded command exec'd (rustup's proxy
//! execs rustc, whose jemalloc is in its executable), probed from the next start.
//!
//! Over 500 lines: the cache's trust rules (ownership, permissions, checksums) are read, written and tested together; the tests start at line 426.
use std::{
    fmt,
    fs::{self, OpenOptions},
    io::{self, Read as _, Write},
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    time::SystemTime,
};

use super::{cfi::Segment, table::Table};

/// Bumped whenever the table format or how tables are built changes: older entries are
/// rebuilt. 3: of two rows at one pc of an FDE the later one (ab7ede2). 4: CFA offsets
/// past 256 KiB in 8-byte words (frames up to 2 MiB). 5: the C runtime's start functions
/// without call-frame information are outermost frames (musl's).
pub const FORMAT_VERSION: u32 = 6;
const MAGIC: &[u8; 8] = b"MTUNWTB\0";
/// Default bound of the cache's size.
pub const DEFAULT_MAX_BYTES: u64 = 512 << 20;
pub const DEFAULT_DIR: &str = "/var/cache/memtrace/unwind";

/// What identifies a file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FileKey {
    /// The GNU build id and the file's size.
    BuildId { build_id: Vec<u8>, size: u64 },
    /// No build id: where the file is and when it last changed.
    Inode { dev: u64, ino: u64, size: u64, mtime_ns: i128 },
}

impl FileKey {
    /// The key of the file at `path` (its build id is read from its notes).
    pub fn of(path: &Path) -> io::Result<Self> {
        let md = fs::metadata(path)?;
        Ok(match crate::elf::build_id(path) {
            Some(build_id) if !build_id.is_empty() => Self::BuildId { build_id, size: md.size() },
            _ => Self::Inode {
                dev: md.dev(),
                ino: md.ino(),
                size: md.size(),
                mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
            },
        })
    }

    /// The key's bytes, written into the entry and compared on load.
    fn bytes(&self) -> Vec<u8> {
        match self {
            Self::BuildId { build_id, size } => {
                let mut b = vec![1];
                b.extend_from_slice(build_id);
                b.extend_from_slice(&size.to_le_bytes());
                b
            }
            Self::Inode { dev, ino, size, mtime_ns } => {
                let mut b = vec![2];
                for v in [*dev, *ino, *size] {
                    b.extend_from_slice(&v.to_le_bytes());
                }
                b.extend_from_slice(&mtime_ns.to_le_bytes());
                b
            }
        }
    }

    /// The entry's file name.
    fn file_name(&self) -> String {
        key_name(self, "tbl")
    }
}

/// The name of a cache file about `key`, with extension `ext`.
fn key_name(key: &FileKey, ext: &str) -> String {
    let mut h = crc32fast::Hasher::new();
    h.update(&key.bytes());
    let lo = h.finalize();
    let mut h2 = crc32fast::Hasher::new_with_initial(0x6d74_7563);
    h2.update(&key.bytes());
    format!("{}-{:08x}{:08x}.{ext}", FORMAT_VERSION, lo, h2.finalize())
}

impl fmt::Display for FileKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BuildId { build_id, .. } => {
                f.write_str("build id ")?;
                build_id.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
            Self::Inode { dev, ino, .. } => write!(f, "inode {dev}:{ino}"),
        }
    }
}

/// Why an entry was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejected {
    Missing,
    NotAFile,
    ForeignOwner(u32),
    WritableByOthers(u32),
    Truncated,
    BadMagic,
    WrongVersion(u32),
    OtherKey,
    Checksum,
    Io(String),
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str("not in the cache"),
            Self::NotAFile => f.write_str("the entry is not a regular file"),
            Self::ForeignOwner(uid) => write!(f, "the entry is owned by uid {uid}, not root"),
            Self::WritableByOthers(mode) => write!(f, "the entry is writable by others (mode {mode:o})"),
            Self::Truncated => f.write_str("the entry is truncated"),
            Self::BadMagic => f.write_str("the entry is not a memtrace unwind table"),
            Self::WrongVersion(v) => write!(f, "the entry has format version {v}, not {FORMAT_VERSION}"),
            Self::OtherKey => f.write_str("the entry is for another file"),
            Self::Checksum => f.write_str("the entry's checksum does not match"),
            Self::Io(e) => write!(f, "reading the entry failed: {e}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
}

/// Fixed part of an entry: magic, version, key length, pc_base, segments, pages, rows,
/// checksum (of everything after this header).
const HEADER_BYTES: usize = 8 + 4 + 4 + 8 + 4 + 4 + 4 + 4;

impl DiskCache {
    /// The cache in `dir` (created 0700 if missing), bounded to `max_bytes`. Fails if `dir`
    /// is a symlink, not a directory, or writable by others.
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<Self> {
        if let Some(parent) = dir.parent() {
            fs::DirBuilder::new().recursive(true).mode(0o755).create(parent)?;
        }
        match fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let md = fs::symlink_metadata(dir)?;
        if !md.is_dir() {
            return Err(io::Error::other(format!("{} is not a directory", dir.display())));
        }
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if md.uid() != 0 && md.uid() != euid {
            return Err(io::Error::other(format!("{} is owned by uid {}", dir.display(), md.uid())));
        }
        if md.mode() & 0o022 != 0 {
            return Err(io::Error::other(format!("{} is writable by others", dir.display())));
        }
        Ok(Self { dir: dir.to_path_buf(), max_bytes })
    }

    /// The cache at the default place (or `MEMTRACE_CACHE_DIR`), if it can be used.
    pub fn open_default() -> Option<Self> {
        let dir = std::env::var_os("MEMTRACE_CACHE_DIR").map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from);
        match Self::open(&dir, DEFAULT_MAX_BYTES) {
            Ok(cache) => Some(cache),
            Err(e) => {
                log::debug!("unwind cache {}: {e}; tables are built afresh", dir.display());
                None
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, key: &FileKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The table cached for `key`, or why there is none to trust.
    /// Its rows are read in place from the mapped entry; the pages its checks read are
    /// handed back at once ([`Table::drop_resident`]).
    pub fn load(&self, key: &FileKey) -> Result<Table, Rejected> {
        let file = open_trusted(&self.path_of(key))?;
        let len = file.metadata().map_err(|e| Rejected::Io(e.to_string()))?.len();
        // (An empty file cannot be mapped; decode checks the rest.)
        if len < MAGIC.len() as u64 {
            return Err(Rejected::Truncated);
        }
        // SAFETY: the entry is a regular file that only root (or we) may write, and
        // memtrace never writes an entry in place: it writes a new file and renames it over
        // the old one (`write_atomically`), so the mapped inode's bytes do not change.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Rejected::Io(e.to_string()))?;
        let table = decode(std::sync::Arc::new(map), key)?;
        table.drop_resident();
        Ok(table)
    }

    /// The files `program` ran code from last time (empty if unknown or untrusted).
    pub fn companions(&self, program: &FileKey) -> Vec<PathBuf> {
        self.list(program, COMPANIONS)
    }

    /// Remembers the files `program` ran code from: `used` first, then those of earlier
    /// runs, at most [`MAX_COMPANIONS`].
    pub fn store_companions(&self, program: &FileKey, used: &[PathBuf]) -> io::Result<()> {
        self.store_list(program, COMPANIONS, used, MAX_COMPANIONS)
    }

    /// The programs with an allocator of their own that `program` (a command recorded) or
    /// its children exec'd last time: probed from the start of the next session, so their
    /// first allocations are seen (empty if unknown or untrusted).
    pub fn allocator_programs(&self, program: &FileKey) -> Vec<PathBuf> {
        self.list(program, ALLOCATOR_PROGRAMS)
    }

    /// Remembers the programs with an allocator of their own a command exec'd: `found`
    /// first, then those of earlier runs, at most `max`.
    pub fn store_allocator_programs(&self, program: &FileKey, found: &[PathBuf], max: usize) -> io::Result<()> {
        self.store_list(program, ALLOCATOR_PROGRAMS, found, max)
    }

    /// A list of paths kept for `program`, of the kind `ext` names.
    fn list(&self, program: &FileKey, ext: &str) -> Vec<PathBuf> {
        let data = match read_trusted(&self.dir.join(key_name(program, ext))) {
            Ok(data) => data,
            Err(Rejected::Missing) => return Vec::new(),
            Err(e) => {
                log::debug!("unwind cache: the {ext} list of {program}: {e}; ignored");
                return Vec::new();
            }
        };
        parse_list(&data, program, ext)
    }

    fn store_list(&self, program: &FileKey, ext: &str, first: &[PathBuf], max: usize) -> io::Result<()> {
        let mut all: Vec<PathBuf> = Vec::new();
        for p in first.iter().cloned().chain(self.list(program, ext)) {
            if all.len() < max && !all.contains(&p) {
                all.push(p);
            }
        }
        let name = key_name(program, ext);
        let tmp = self.dir.join(temp_name(&name));
        write_atomically(&tmp, &self.dir.join(name), |out| out.write_all(&encode_list(program, ext, &all)))
    }

    /// Stores the table of `key`, then evicts the least recently used entries beyond the
    /// size bound.
    pub fn store(&self, key: &FileKey, table: &Table) -> io::Result<()> {
        let path = self.path_of(key);
        let tmp = self.dir.join(temp_name(&key.file_name()));
        write_atomically(&tmp, &path, |out| encode_into(key, table, out))?;
        self.evict();
        Ok(())
    }

    /// Deletes the oldest entries until the cache fits its bound.
    fn evict(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(|e| {
                let e = e.ok()?;
                let md = e.metadata().ok()?;
                (md.is_file() && e.file_name().to_string_lossy().ends_with(".tbl"))
                    .then(|| (md.modified().unwrap_or(SystemTime::UNIX_EPOCH), md.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if fs::remove_file(&path).is_ok() {
                log::debug!("unwind cache: evicted {}", path.display());
                total -= len;
            }
        }
    }
}

/// Most files remembered per program.
pub const MAX_COMPANIONS: usize = 1024;
const COMPANIONS_MAGIC: &str = "memtrace-unwind-companions";
/// The extensions of a program's lists: the files it ran code from, the programs with an
/// allocator of their own it exec'd.
const COMPANIONS: &str = "use";
const ALLOCATOR_PROGRAMS: &str = "exec";

/// The bytes of a cache file, if it is one to trust: a regular file (not a symlink) owned
/// by root or by us that no one else may write. Marks it recently used.
pub(crate) fn read_trusted(path: &Path) -> Result<Vec<u8>, Rejected> {
    let mut file = open_trusted(path)?;
    let mut data = Vec::new();
    file.read_to_end(&mut data).map_err(|e| Rejected::Io(e.to_string()))?;
    Ok(data)
}

/// The cache file at `path`, opened, if it is one to trust (as [`read_trusted`] says);
/// marked recently used.
fn open_trusted(path: &Path) -> Result<fs::File, Rejected> {
    let file = match OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Rejected::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(Rejected::NotAFile),
        Err(e) => return Err(Rejected::Io(e.to_string())),
    };
    let md = file.metadata().map_err(|e| Rejected::Io(e.to_string()))?;
    if !md.is_file() {
        return Err(Rejected::NotAFile);
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if md.uid() != 0 && md.uid() != euid {
        return Err(Rejected::ForeignOwner(md.uid()));
    }
    if md.mode() & 0o022 != 0 {
        return Err(Rejected::WritableByOthers(md.mode() & 0o7777));
    }
    // Recently used: the eviction keeps it.
    let _ = file.set_modified(SystemTime::now());
    Ok(file)
}

/// A temporary file's name for an entry being written: unique to this process and this
/// write (two workers storing the same entry at once each write their own).
fn temp_name(entry: &str) -> String {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(".{entry}.{}.{n}.tmp", std::process::id())
}

/// Writes what `write` gives to `tmp` (new, 0600, synced) and renames it to `path`.
pub(crate) fn write_atomically(
    tmp: &Path,
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let result = (|| {
        let f = OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(tmp)?;
        let mut out = io::BufWriter::with_capacity(1 << 16, f);
        write(&mut out)?;
        let f = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        f.sync_data()?;
        fs::rename(tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(tmp);
    }
    result
}

/// A program's list: a header line naming the format and the program's key (and so the
/// kind of list), then one absolute path per line.
fn encode_list(program: &FileKey, ext: &str, paths: &[PathBuf]) -> Vec<u8> {
    let mut out = format!("{COMPANIONS_MAGIC} {FORMAT_VERSION} {}\n", key_name(program, ext)).into_bytes();
    for p in paths {
        if let Some(s) = p.to_str().filter(|s| s.starts_with('/') && !s.contains('\n')) {
            out.extend_from_slice(s.as_bytes());
            out.push(b'\n');
        }
    }
    out
}

/// The paths of a list written for `program` of the kind `ext`; nothing if it is for
/// another program or kind, another version, or not a list.
fn parse_list(data: &[u8], program: &FileKey, ext: &str) -> Vec<PathBuf> {
    let Ok(text) = std::str::from_utf8(data) else { return Vec::new() };
    let mut lines = text.lines();
    let header = format!("{COMPANIONS_MAGIC} {FORMAT_VERSION} {}", key_name(program, ext));
    if lines.next() != Some(header.as_str()) {
        return Vec::new();
    }
    lines.filter(|l| l.starts_with('/')).take(MAX_COMPANIONS).map(PathBuf::from).collect()
}

fn encode_into(key: &FileKey, table: &Table, out: &mut dyn Write) -> io::Result<()> {
    // Streamed, its checksum first: a big library's entry is 20 MB, and built in memory
    // it was there twice (the body, then the whole entry) beside the table.
    let key = key.bytes();
    let mut hasher = crc32fast::Hasher::new();
    write_body(&key, table, &mut |bytes| {
        hasher.update(bytes);
        Ok(())
    })?;
    let mut header = Vec::with_capacity(HEADER_BYTES);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&(key.len() as u32).to_le_bytes());
    header.extend_from_slice(&table.pc_base.to_le_bytes());
    header.extend_from_slice(&(table.segments.len() as u32).to_le_bytes());
    header.extend_from_slice(&(table.page_entries() as u32).to_le_bytes());
    header.extend_from_slice(&(table.row_count() as u32).to_le_bytes());
    header.extend_from_slice(&hasher.finalize().to_le_bytes());
    out.write_all(&header)?;
    write_body(&key, table, &mut |bytes| out.write_all(bytes))
}

/// An entry's bytes, in memory.
#[cfg(test)]
fn encode(key: &FileKey, table: &Table) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(key, table, &mut out).expect("writing to memory");
    out
}

/// Gives `emit` the body of an entry (after its header), in pieces of up to 64 KiB: the
/// key, the segments, the page index, the rows.
fn write_body(key: &[u8], table: &Table, emit: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    const PIECE: usize = 1 << 16;
    emit(key)?;
    let mut piece: Vec<u8> = Vec::with_capacity(PIECE);
    let mut put = |bytes: &[u8], piece: &mut Vec<u8>| -> io::Result<()> {
        piece.extend_from_slice(bytes);
        if piece.len() >= PIECE - 8 {
            emit(piece)?;
            piece.clear();
        }
        Ok(())
    };
    for s in &table.segments {
        for v in [s.file_offset, s.vaddr, s.file_size, u64::from(s.executable)] {
            put(&v.to_le_bytes(), &mut piece)?;
        }
    }
    for p in table.pages() {
        put(&p.to_le_bytes(), &mut piece)?;
    }
    for r in table.rows() {
        put(&r.to_le_bytes(), &mut piece)?;
    }
    emit(&piece)
}

/// The table of an entry's bytes, read in place (its page index and rows stay in `map`).
fn decode(map: std::sync::Arc<memmap2::Mmap>, key: &FileKey) -> Result<Table, Rejected> {
    let data: &[u8] = &map;
    let u32_at = |at: usize| -> Result<u32, Rejected> {
        Ok(u32::from_le_bytes(data.get(at..at + 4).ok_or(Rejected::Truncated)?.try_into().expect("4 bytes")))
    };
    let u64_at = |at: usize| -> Result<u64, Rejected> {
        Ok(u64::from_le_bytes(data.get(at..at + 8).ok_or(Rejected::Truncated)?.try_into().expect("8 bytes")))
    };
    if data.len() < 8 {
        return Err(Rejected::Truncated);
    }
    if &data[..8] != MAGIC {
        return Err(Rejected::BadMagic);
    }
    let version = u32_at(8)?;
    if version != FORMAT_VERSION {
        return Err(Rejected::WrongVersion(version));
    }
    let key_len = u32_at(12)? as usize;
    let pc_base = u64_at(16)?;
    let (n_segments, n_pages, n_rows) = (u32_at(24)? as usize, u32_at(28)? as usize, u32_at(32)? as usize);
    let checksum = u32_at(36)?;
    let body = &data[HEADER_BYTES.min(data.len())..];
    let need = key_len
        .checked_add(n_segments.checked_mul(32).ok_or(Rejected::Truncated)?)
        .and_then(|n| n.checked_add(n_pages.checked_mul(4)?))
        .and_then(|n| n.checked_add(n_rows.checked_mul(8)?))
        .ok_or(Rejected::Truncated)?;
    if body.len() != need {
        return Err(Rejected::Truncated);
    }
    if crc32fast::hash(body) != checksum {
        return Err(Rejected::Checksum);
    }
    if body[..key_len] != key.bytes()[..] {
        return Err(Rejected::OtherKey);
    }
    let mut at = key_len;
    let mut word = |n: usize| {
        let v = &body[at..at + n];
        at += n;
        v
    };
    let segments = (0..n_segments)
        .map(|_| {
            let mut v = [0u64; 4];
            for x in &mut v {
                *x = u64::from_le_bytes(word(8).try_into().expect("8 bytes"));
            }
            Segment { file_offset: v[0], vaddr: v[1], file_size: v[2], executable: v[3] != 0 }
        })
        .collect();
    let pages_at = HEADER_BYTES + at;
    let rows_at = pages_at + 4 * n_pages;
    if n_pages == 0 {
        return Err(Rejected::Truncated);
    }
    Table::mapped(pc_base, segments, std::sync::Arc::clone(&map), (pages_at, n_pages), (rows_at, n_rows))
        .ok_or(Rejected::Truncated)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn table() -> Table {
        Table::new(
            0x1000,
            vec![0, 1, 2],
            vec![1, 2, 3, 4],
            vec![Segment { file_offset: 0, vaddr: 0, file_size: 0x3000, executable: true }],
        )
    }

    fn key() -> FileKey {
        FileKey::BuildId { build_id: vec![7; 20], size: 1234 }
    }

    /// A cache in a fresh directory, removed when the first is dropped.
    fn cache(name: &str) -> (tempfile::TempDir, DiskCache) {
        let tmp = tempfile::Builder::new().prefix(&format!("memtrace-cache-test-{name}-")).tempdir().unwrap();
        let c = DiskCache::open(tmp.path(), 1 << 20).unwrap();
        (tmp, c)
    }

    #[test]
    fn a_stored_table_loads_back() {
        let (_tmp, c) = cache("roundtrip");
        assert_eq!(c.load(&key()), Err(Rejected::Missing));
        c.store(&key(), &table()).unwrap();
        assert_eq!(c.load(&key()).unwrap(), table());
        let other = FileKey::Inode { dev: 1, ino: 2, size: 3, mtime_ns: 4 };
        assert_eq!(c.load(&other), Err(Rejected::Missing));
        let mode = fs::metadata(c.path_of(&key())).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    /// A loaded table is read in place from its entry, and answers every lookup, and gives
    /// the probes the same elements, as the table built from the file's call-frame
    /// information, before and after its resident pages are handed back.
    #[test]
    fn a_loaded_table_is_read_in_place_and_answers_as_the_built_one() {
        let exe = std::env::current_exe().unwrap();
        let cfi = crate::unwind::cfi::Cfi::open(&exe).unwrap();
        let built = cfi.table().unwrap();
        let rows = built.decoded_rows();
        let tmp = tempfile::Builder::new().prefix("memtrace-cache-test-in-place-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        // (The test binary's table is larger than the other tests' bound.)
        let c = DiskCache::open(&dir, 1 << 30).unwrap();
        c.store(&key(), &built).unwrap();
        let loaded = c.load(&key()).unwrap();
        assert!(loaded.is_mapped() && !built.is_mapped());
        assert_eq!(loaded, built);
        assert_eq!(loaded.byte_size(), built.byte_size());
        assert_eq!(loaded.elements(), built.elements());
        loaded.drop_resident();
        for w in rows.windows(2).step_by(5) {
            for vaddr in [w[0].pc, w[1].pc - 1, w[0].pc.wrapping_sub(1)] {
                assert_eq!(loaded.rule_at(vaddr), built.rule_at(vaddr), "{vaddr:#x}");
            }
        }
        let end = rows.last().unwrap().pc;
        for vaddr in [0, end, end + 0x10_0000, u64::MAX] {
            assert_eq!(loaded.rule_at(vaddr), built.rule_at(vaddr), "{vaddr:#x}");
        }
        drop(loaded);
    }

    #[test]
    fn damaged_or_untrusted_entries_are_rejected() {
        let (_tmp, c) = cache("damaged");
        c.store(&key(), &table()).unwrap();
        let path = c.path_of(&key());
        let good = fs::read(&path).unwrap();
        let write = |bytes: &[u8]| {
            fs::remove_file(&path).unwrap();
            let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&path).unwrap();
            f.write_all(bytes).unwrap();
        };
        let mut bad = good.clone();
        *bad.last_mut().unwrap() ^= 1;
        write(&bad);
        assert_eq!(c.load(&key()), Err(Rejected::Checksum));
        write(&good[..good.len() - 3]);
        assert_eq!(c.load(&key()), Err(Rejected::Truncated));
        let mut old = good.clone();
        old[8..12].copy_from_slice(&0u32.to_le_bytes());
        write(&old);
        assert_eq!(c.load(&key()), Err(Rejected::WrongVersion(0)));
        write(b"something else entirely, long enough");
        assert_eq!(c.load(&key()), Err(Rejected::BadMagic));
        write(&good);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(c.load(&key()), Err(Rejected::WritableByOthers(_))));
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        // SAFETY: chown of a file this test created.
        let rc = unsafe {
            libc::chown(std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap().as_ptr(), 65534, 65534)
        };
        if rc == 0 {
            assert_eq!(c.load(&key()), Err(Rejected::ForeignOwner(65534)));
        }
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &path).unwrap();
        assert_eq!(c.load(&key()), Err(Rejected::NotAFile));
        // A damaged entry is replaced by a good one.
        fs::remove_file(&path).unwrap();
        c.store(&key(), &table()).unwrap();
        assert_eq!(c.load(&key()).unwrap(), table());
    }

    #[test]
    fn a_programs_files_are_remembered_newest_first_and_bounded() {
        let (_tmp, c) = cache("companions");
        let program = key();
        assert!(c.companions(&program).is_empty(), "nothing known yet");
        let a = [PathBuf::from("/usr/lib/liba.so"), PathBuf::from("/usr/lib/libb.so")];
        c.store_companions(&program, &a).unwrap();
        assert_eq!(c.companions(&program), a);
        // A later run: its files first, the earlier ones kept, no duplicates; paths that
        // are not absolute or span lines are never written.
        let b = [PathBuf::from("/opt/libc.so"), PathBuf::from("/usr/lib/libb.so"), PathBuf::from("rel.so")];
        c.store_companions(&program, &b).unwrap();
        let want: Vec<PathBuf> = ["/opt/libc.so", "/usr/lib/libb.so", "/usr/lib/liba.so"].map(PathBuf::from).into();
        assert_eq!(c.companions(&program), want);
        // Another program's list, a damaged one, an untrusted one: nothing.
        let other = FileKey::BuildId { build_id: vec![9; 20], size: 1 };
        assert!(c.companions(&other).is_empty());
        let path = c.dir.join(key_name(&program, COMPANIONS));
        fs::write(&path, b"garbage\n/usr/lib/liba.so\n").unwrap();
        assert!(c.companions(&program).is_empty());
        fs::write(&path, encode_list(&program, COMPANIONS, &a)).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        assert!(c.companions(&program).is_empty(), "writable by others");
        // Bounded.
        let many: Vec<PathBuf> = (0..MAX_COMPANIONS + 10).map(|i| PathBuf::from(format!("/l/{i}.so"))).collect();
        fs::remove_file(&path).unwrap();
        c.store_companions(&program, &many).unwrap();
        assert_eq!(c.companions(&program).len(), MAX_COMPANIONS);
        // The programs with their own allocator it exec'd: a list apart.
        assert!(c.allocator_programs(&program).is_empty());
        let rustc = [PathBuf::from("/opt/rust/bin/rustc")];
        c.store_allocator_programs(&program, &rustc, 32).unwrap();
        assert_eq!(c.allocator_programs(&program), rustc);
        assert_eq!(c.companions(&program).len(), MAX_COMPANIONS);
    }

    #[test]
    fn the_least_recently_used_entries_are_evicted() {
        let tmp = tempfile::Builder::new().prefix("memtrace-cache-test-evict-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let one = encode(&key(), &table()).len() as u64;
        let c = DiskCache::open(&dir, one * 2).unwrap();
        let keys: Vec<FileKey> = (0..3).map(|i| FileKey::BuildId { build_id: vec![i; 20], size: 1 }).collect();
        c.store(&keys[0], &table()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.store(&keys[1], &table()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        // Using the first makes the second the least recent.
        c.load(&keys[0]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.store(&keys[2], &table()).unwrap();
        assert!(c.load(&keys[0]).is_ok());
        assert_eq!(c.load(&keys[1]), Err(Rejected::Missing));
        assert!(c.load(&keys[2]).is_ok());
    }

    #[test]
    fn a_cache_directory_writable_by_others_is_refused() {
        let tmp = tempfile::Builder::new().prefix("memtrace-cache-test-perm-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(DiskCache::open(&dir, 1).is_err());
    }
}
