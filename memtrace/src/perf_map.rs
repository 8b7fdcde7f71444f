//! Names for JIT-compiled code from the runtime's perf map: `/tmp/perf-PID.map`, one line
//! per piece of code, `START SIZE NAME` (hexadecimal start and size), the file `perf` reads
//! and node (`--perf-basic-prof`), the JVM's perf-map agents, Python 3.12 (`-X perf`) and
//! .NET (`DOTNET_PerfMapEnabled`) write. Frames in memory without a file are named by
//! address only without it.
//!
//! memtrace runs as root and the file lies in a directory anyone writes to, so it is read
//! only as what the runtime itself wrote: looked up in the process's own root (its
//! container's `/tmp`, under the pid it has there) with no symbolic link followed, and
//! taken only when it is a regular file owned by the process's user or root, written
//! since the process started (a map a process of the same pid left earlier is stale). A
//! process gone before its stacks were read is looked for in memtrace's own `/tmp`: a
//! map of root's written since the recording began.
use std::{
    collections::BTreeMap,
    ffi::CString,
    fs::File,
    io::{BufReader, Read as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// A perf map read at most this far (a long-running JVM's can grow without end).
const MAX_BYTES: u64 = 256 << 20;

/// Where a process's perf map is to be found, noted while the process lives: its root
/// directory (still open once it exits), its pid in its own namespace, its user, its start.
#[derive(Debug)]
pub struct PerfMapSource {
    root: OwnedFd,
    ns_pid: u32,
    uids: [u32; 2],
    started: SystemTime,
}

impl PerfMapSource {
    /// Process `pid`: while it lives, as described above; once gone (it exited before its
    /// stacks were read), in memtrace's own `/tmp` under that pid, a map of root's written
    /// since `since` (the recording's start).
    pub fn of(pid: u32, since: SystemTime) -> Option<Self> {
        Self::living(pid).or_else(|| Some(Self { root: directory("/")?, ns_pid: pid, uids: [0, 0], started: since }))
    }

    fn living(pid: u32) -> Option<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::split_whitespace);
        let ns_pid = field("NSpid:").and_then(|f| f.last()?.parse().ok()).unwrap_or(pid);
        let mut uid = field("Uid:")?.map(|u| u.parse::<u32>().ok());
        let uids = [uid.next()??, uid.nth(0)??];
        let started = process_start(pid)?;
        let root = directory(&format!("/proc/{pid}/root"))?;
        Some(Self { root, ns_pid, uids, started })
    }

    /// The entries of the process's perf map that cover one of `wanted` (sorted): None
    /// when it has none, or none memtrace may trust (see the module's notes).
    pub fn read(&self, wanted: &[u64]) -> Option<PerfMap> {
        let file = self.open()?;
        let meta = file.metadata().ok()?;
        let owner_ok = meta.uid() == 0 || self.uids.contains(&meta.uid());
        // The start is known to the second (the boot time's precision).
        let fresh = meta.modified().ok()? + Duration::from_secs(2) >= self.started;
        if !meta.file_type().is_file() || !owner_ok || !fresh {
            log::debug!(
                "perf-{}.map: not the process's own (owner {}, fresh {fresh}): not read",
                self.ns_pid,
                meta.uid()
            );
            return None;
        }
        Some(PerfMap::from_reader(BufReader::new(file.take(MAX_BYTES)), wanted))
    }

    /// `tmp/perf-PID.map` under the process's root, resolved inside it, no link followed,
    /// without blocking (a FIFO planted there).
    fn open(&self) -> Option<File> {
        let path = CString::new(format!("tmp/perf-{}.map", self.ns_pid)).ok()?;
        // SAFETY: `open_how` is plain integers, for which zero is a value.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: openat2(dirfd, path, how, size) with a live directory descriptor, a
        // NUL-terminated path and an `open_how` of the size passed; the descriptor it returns
        // is owned by the File below, alone.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.root.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                size_of::<libc::open_how>(),
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: a descriptor openat2 just returned, owned by nothing else.
        Some(unsafe { File::from_raw_fd(fd as i32) })
    }
}

/// A descriptor of directory `path` (still valid once a process it was the root of exits).
fn directory(path: &str) -> Option<OwnedFd> {
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    Some(dir.into())
}

/// When process `pid` started (`/proc/PID/stat`'s start time after the boot time).
fn process_start(pid: u32) -> Option<SystemTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command's closing parenthesis begin with the third (state);
    // the start time is the 22nd.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let ticks: u64 = rest.split(' ').nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(UNIX_EPOCH + Duration::from_secs(boot) + Duration::from_millis(ticks.saturating_mul(1000) / hz))
}

/// The code a perf map names, by start address.
#[derive(Debug, Default)]
pub struct PerfMap {
    /// start → (end, name); a later line for the same start replaces an earlier one (code
    /// compiled again at a reused address).
    entries: BTreeMap<u64, (u64, String)>,
}

impl PerfMap {
    /// Every well-formed line of a perf map; others are skipped.
    pub fn parse(text: &str) -> Self {
        let mut map = Self::default();
        for line in text.lines() {
            map.add(line, None);
        }
        map
    }

    /// The well-formed lines of a perf map that cover one of `wanted` (sorted), read as
    /// they come (a map can be hundreds of MB, of which a recording needs a few lines); a
    /// line that is not UTF-8 is read with its bad bytes replaced.
    fn from_reader(reader: impl std::io::BufRead, wanted: &[u64]) -> Self {
        let mut map = Self::default();
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            map.add(&String::from_utf8_lossy(&line), Some(wanted));
        }
        map
    }

    fn add(&mut self, line: &str, wanted: Option<&[u64]>) {
        let mut parts = line.trim().splitn(3, ' ');
        let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next()) else { return };
        let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
        let (Some(start), Some(size)) = (hex(start), hex(size)) else { return };
        let (name, end) = (name.trim(), start.saturating_add(size));
        if size == 0 || name.is_empty() {
            return;
        }
        if let Some(wanted) = wanted {
            let i = wanted.partition_point(|&w| w < start);
            if wanted.get(i).is_none_or(|&w| w >= end) {
                return;
            }
        }
        self.entries.insert(start, (end, name.to_string()));
    }

    /// The name of the code at `addr`.
    pub fn name(&self, addr: u64) -> Option<&str> {
        let (_, (end, name)) = self.entries.range(..=addr).next_back()?;
        (addr < *end).then_some(name.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn names_the_code_each_line_covers() {
        let map = PerfMap::parse(
            "7f0000001000 40 LazyCompile:~main /app/index.js:1\n\
             garbage line\n\
             7f0000002000 0 empty\n\
             0x7f0000003000 10 Interpreter:foo\n\
             7f0000001000 20 LazyCompile:*main /app/index.js:1\n",
        );
        assert_eq!(map.name(0x7f00_0000_0fff), None);
        // The later line for a start replaces the earlier one.
        assert_eq!(map.name(0x7f00_0000_1000), Some("LazyCompile:*main /app/index.js:1"));
        assert_eq!(map.name(0x7f00_0000_101f), Some("LazyCompile:*main /app/index.js:1"));
        assert_eq!(map.name(0x7f00_0000_1020), None);
        assert_eq!(map.name(0x7f00_0000_2000), None, "a zero-sized entry names nothing");
        assert_eq!(map.name(0x7f00_0000_3008), Some("Interpreter:foo"));
        assert!(PerfMap::parse("").is_empty());
    }

    #[test]
    fn a_read_keeps_the_lines_wanted_and_survives_bytes_not_utf8() {
        let text = b"1000 10 a\n2000 10 b\xff\xfe\n3000 10 c\n";
        let map = PerfMap::from_reader(&text[..], &[0x2004, 0x3000]);
        assert_eq!(map.name(0x1000), None, "not wanted");
        assert_eq!(map.name(0x2004), Some("b\u{fffd}\u{fffd}"));
        assert_eq!(map.name(0x3000), Some("c"));
    }

    /// This very process's perf map is read from its root, and a planted link, a FIFO, a
    /// file older than the process or another user's are not.
    #[test]
    fn only_the_process_own_fresh_map_is_read() {
        let pid = std::process::id();
        let source = PerfMapSource::living(pid).expect("this process");
        let path = format!("/tmp/perf-{}.map", source.ns_pid);
        let _ = std::fs::remove_file(&path);
        assert!(source.read(&[0x1000]).is_none(), "none written");
        let mut f = File::create(&path).unwrap();
        writeln!(f, "1000 10 mine").unwrap();
        drop(f);
        assert_eq!(source.read(&[0x1000]).unwrap().name(0x1000), Some("mine"));
        // Written before the process started: a map an earlier process of this pid left.
        let old = File::options().write(true).open(&path).unwrap();
        old.set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000)).unwrap();
        assert!(source.read(&[0x1000]).is_none(), "stale");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
        assert!(source.read(&[0x1000]).is_none(), "a link");
        std::fs::remove_file(&path).unwrap();
        let c = CString::new(path.clone()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(source.read(&[0x1000]).is_none(), "a FIFO, without blocking");
        std::fs::remove_file(&path).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // A process of user 12345 and a map of user 54321 (root's maps are trusted).
            let other = PerfMapSource { uids: [12345, 12345], ..PerfMapSource::living(pid).unwrap() };
            let mut f = File::create(&path).unwrap();
            writeln!(f, "1000 10 mine").unwrap();
            drop(f);
            // SAFETY: chown with a NUL-terminated path.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 54321, 54321) }, 0);
            assert!(other.read(&[0x1000]).is_none(), "another user's");
            std::fs::remove_file(&path).unwrap();
        }
    }

    proptest::proptest! {
        /// A perf map is another program's file: whatever it holds is read without panic,
        /// and a name found covers the address asked for.
        #[test]
        fn any_text_is_read(text in "[0-9a-fx \\n:A-Za-z]{0,400}", addr in 0u64..0x1_0000) {
            let map = PerfMap::parse(&text);
            if let Some(name) = map.name(addr) {
                let (start, (end, n)) = map.entries.range(..=addr).next_back().unwrap();
                proptest::prop_assert!(*start <= addr && addr < *end && n == name);
            }
        }
    }
}
