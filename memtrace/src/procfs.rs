//! What memtrace reads from /proc: memory maps, command names, executables, process state.
use std::{
    fs, io,
    path::{Path, PathBuf},
};

/// One line of /proc/PID/maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub executable: bool,
    /// Offset in the mapped file.
    pub offset: u64,
    pub inode: u64,
    /// File path, or a pseudo name like `[heap]`, or empty for anonymous memory.
    pub path: PathBuf,
    /// The file was deleted (or replaced) after it was mapped.
    pub deleted: bool,
}

impl Mapping {
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.path.is_absolute()
    }

    /// File offset of `addr`, which must lie in this mapping.
    pub fn file_offset(&self, addr: u64) -> u64 {
        addr - self.start + self.offset
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maps {
    pub mappings: Vec<Mapping>,
}

impl Maps {
    /// The maps of a live process. A process that exited (a zombie) or a kernel thread has
    /// none: that is an error, so callers never replace what they knew with nothing.
    pub fn read(pid: u32) -> io::Result<Self> {
        let maps = Self::parse(&fs::read_to_string(format!("/proc/{pid}/maps"))?);
        if maps.mappings.is_empty() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("process {pid} has no address space")));
        }
        Ok(maps)
    }

    pub fn read_self() -> io::Result<Self> {
        Ok(Self::parse(&fs::read_to_string("/proc/self/maps")?))
    }

    pub fn parse(text: &str) -> Self {
        let mappings = text.lines().filter_map(parse_line).collect();
        Self { mappings }
    }

    pub fn file_mappings(&self) -> impl Iterator<Item = &Mapping> {
        self.mappings.iter().filter(|m| m.is_file())
    }

    /// The mapping containing `addr` (mappings are sorted by address).
    pub fn find(&self, addr: u64) -> Option<&Mapping> {
        let i = self.mappings.partition_point(|m| m.end <= addr);
        self.mappings.get(i).filter(|m| m.start <= addr)
    }
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut parts = line.splitn(6, ' ');
    let range = parts.next()?;
    let perms = parts.next()?;
    let offset = parts.next()?;
    let _dev = parts.next()?;
    let inode = parts.next()?;
    let path = parts.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    let (path, deleted) = match path.strip_suffix(" (deleted)") {
        Some(p) => (p, true),
        None => (path, false),
    };
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        path: PathBuf::from(path),
        deleted,
    })
}

/// Command name (`comm`) of a task, without the trailing newline.
pub fn comm(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .or_else(|_| fs::read_to_string(format!("/proc/{tid}/comm")))
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string())
}

/// The kernel memory charged to the BPF maps this process holds descriptors of (the
/// `memlock` of each in `/proc/self/fdinfo`).
pub fn own_bpf_map_bytes() -> u64 {
    let Ok(fds) = fs::read_dir("/proc/self/fd") else { return 0 };
    fds.filter_map(|e| {
        let e = e.ok()?;
        let target = fs::read_link(e.path()).ok()?;
        if target.as_os_str() != "anon_inode:bpf-map" {
            return None;
        }
        let info = fs::read_to_string(Path::new("/proc/self/fdinfo").join(e.file_name())).ok()?;
        info.lines().find_map(|l| l.strip_prefix("memlock:")?.trim().parse::<u64>().ok())
    })
    .sum()
}

/// Resident bytes of this process's mappings of BPF maps: the rings, whose pages the
/// kernel maps all at `mmap` (see `probes::ring`). Part of the resident set, though the
/// kernel's memory, counted in [`own_bpf_map_bytes`].
pub fn own_bpf_mapped_rss_bytes() -> u64 {
    fs::read_to_string("/proc/self/smaps").map_or(0, |smaps| bpf_mapped_rss(&smaps))
}

/// [`own_bpf_mapped_rss_bytes`] of the text of a smaps file.
fn bpf_mapped_rss(smaps: &str) -> u64 {
    smaps_rss(smaps).filter(|(head, _)| head.trim_end().ends_with("anon_inode:bpf-map")).map(|(_, rss)| rss).sum()
}

/// Each mapping of a smaps text: its first line (as `/proc/PID/maps` has it) and its
/// resident bytes.
pub fn smaps_rss(smaps: &str) -> impl Iterator<Item = (&str, u64)> {
    let mut lines = smaps.lines().peekable();
    std::iter::from_fn(move || {
        loop {
            let head = lines.next()?;
            let first = head.split_whitespace().next().unwrap_or("");
            if !(first.contains('-') && first.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')) {
                continue;
            }
            let mut rss = 0;
            // Its `Key: value` lines, up to the next mapping's first line.
            while let Some(line) = lines.next_if(|l| l.split_whitespace().next().is_some_and(|f| f.ends_with(':'))) {
                if let Some(kb) = line.strip_prefix("Rss:") {
                    rss = kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
                }
            }
            return Some((head, rss));
        }
    })
}

pub fn exe(pid: u32) -> io::Result<PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe"))
}

/// A path as seen from inside the process's mount namespace (containers): prefer the
/// process's root when the file is not visible from ours.
pub fn path_in_process(pid: u32, path: &Path) -> PathBuf {
    let rooted = Path::new("/proc").join(pid.to_string()).join("root").join(path.strip_prefix("/").unwrap_or(path));
    // The kernel names a file of another mount namespace (a container's) from that
    // namespace's root: a file of ours with the name is another one (its copy of the C
    // library is not the one we probe). In ours (a chroot too) names are from our root.
    // Where both name one file (a service's private namespace sharing our `/usr`: most),
    // ours: it outlives the process.
    if other_mount_namespace(pid)
        && let Ok(theirs) = fs::metadata(&rooted)
    {
        use std::os::unix::fs::MetadataExt as _;
        let same = fs::metadata(path).is_ok_and(|ours| (ours.dev(), ours.ino()) == (theirs.dev(), theirs.ino()));
        return if same { path.to_path_buf() } else { rooted };
    }
    if path.exists() {
        return path.to_path_buf();
    }
    if rooted.exists() { rooted } else { path.to_path_buf() }
}

/// Whether process `pid` runs in a mount namespace other than ours (false when it cannot
/// be told: the process is gone, or not ours to look into).
fn other_mount_namespace(pid: u32) -> bool {
    static OURS: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    match (fs::read_link(format!("/proc/{pid}/ns/mnt")), OURS.get_or_init(|| fs::read_link("/proc/self/ns/mnt").ok())) {
        (Ok(theirs), Some(ours)) => &theirs != ours,
        _ => false,
    }
}

/// The root directory of process `pid` when it is not ours (a chroot, a container): the
/// file system its dynamic linker loads libraries from, as a path of ours (a chroot's
/// directory; `/proc/PID/root` for another mount namespace, whose root has no name here).
/// None when it is ours, or cannot be told (the process is gone).
pub fn foreign_root(pid: u32) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    let root = Path::new("/proc").join(pid.to_string()).join("root");
    let (theirs, ours) = (fs::metadata(&root).ok()?, fs::metadata("/").ok()?);
    if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
        return None;
    }
    if !other_mount_namespace(pid)
        && let Ok(dir) = fs::read_link(&root)
        && dir.is_absolute()
        && dir.is_dir()
    {
        return Some(dir);
    }
    Some(root)
}

/// The process state letter from /proc/PID/stat ('R', 'S', 'Z', ...), and whether it is a
/// kernel thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessState {
    pub state: char,
    pub kernel_thread: bool,
}

pub fn process_state(pid: u32) -> io::Result<ProcessState> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name is in parentheses and may contain spaces: parse after the last ')'.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next()).unwrap_or('?');
    // Field 9 of stat is flags; after the ')' split it is index 6. PF_KTHREAD = 0x00200000.
    let flags: u64 = fields.get(6).and_then(|f| f.parse().ok()).unwrap_or(0);
    Ok(ProcessState { state, kernel_thread: flags & 0x0020_0000 != 0 })
}

/// When process `pid` started, in clock ticks since boot (`/proc/PID/stat`'s 22nd field).
pub fn start_ticks(pid: u32) -> io::Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    start_ticks_of(&stat).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no start time in stat"))
}

fn start_ticks_of(stat: &str) -> Option<u64> {
    // The fields after the command's closing parenthesis begin with the third (state).
    let after = stat.rsplit_once(')')?.1;
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Clock ticks since boot now (`CLOCK_BOOTTIME`, the clock `/proc/PID/stat` starts from).
pub fn boot_ticks_now() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, which lives for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let ns = (ts.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec.max(0) as u64);
    ns / (1_000_000_000 / hz).max(1)
}

/// LD_PRELOAD entries of a process's environment.
pub fn ld_preload(pid: u32) -> Vec<PathBuf> {
    let Ok(environ) = fs::read(format!("/proc/{pid}/environ")) else {
        return Vec::new();
    };
    environ
        .split(|&b| b == 0)
        .filter_map(|var| var.strip_prefix(b"LD_PRELOAD="))
        .flat_map(|v| {
            String::from_utf8_lossy(v)
                .split([':', ' '])
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every process id currently in /proc.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// The kernel's functions as `/proc/kallsyms` lists them (text symbols, weak ones too),
/// sorted by start address, each with what `of` makes of its name (empty when the file
/// cannot be read, or shows no addresses).
pub fn kernel_functions<T: Ord>(mut of: impl FnMut(&str) -> T) -> Vec<(u64, T)> {
    let Ok(text) = std::fs::read_to_string("/proc/kallsyms") else { return Vec::new() };
    let mut starts: Vec<(u64, T)> = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let address = u64::from_str_radix(parts.next()?, 16).ok().filter(|&a| a != 0)?;
            let kind = parts.next()?;
            let name = parts.next()?;
            matches!(kind, "t" | "T" | "w" | "W").then(|| (address, of(name)))
        })
        .collect();
    starts.sort_unstable();
    starts
}

#[cfg(test)]
mod tests {

    /// Our own files are named as they are; a process in another mount namespace names
    /// its files from its root where it sees another file by that name, and from ours
    /// where it sees the same one. Needs root (`unshare -m`, a tmpfs mounted there).
    #[test]
    fn a_process_in_another_mount_namespace_names_its_files_from_its_root() {
        use std::path::Path;
        let me = std::process::id();
        assert_eq!(super::path_in_process(me, Path::new("/etc/os-release")), Path::new("/etc/os-release"));
        assert_eq!(super::foreign_root(me), None);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: a mount namespace needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ours = dir.path().join("f");
        std::fs::write(&ours, "ours").unwrap();
        let script = format!(
            "mount -t tmpfs none {d} && echo theirs > {d}/f && touch {d}/ready && sleep 5",
            d = dir.path().display()
        );
        let mut child = std::process::Command::new("unshare").args(["-m", "sh", "-c", &script]).spawn().unwrap();
        let pid = child.id();
        let root = Path::new("/proc").join(pid.to_string()).join("root");
        let ready = root.join(dir.path().join("ready").strip_prefix("/").unwrap());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !ready.exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let theirs = super::path_in_process(pid, &ours);
        let shared = super::path_in_process(pid, Path::new("/etc/os-release"));
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(theirs, root.join(ours.strip_prefix("/").unwrap()), "another file by that name");
        assert_eq!(shared, Path::new("/etc/os-release"), "the same file");
    }

    #[test]
    fn a_start_time_is_read_after_a_command_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 1000 10";
        assert_eq!(super::start_ticks_of(stat), Some(123456));
        assert_eq!(super::start_ticks_of("42 (cut) S 1"), None);
        let me = super::start_ticks(std::process::id()).unwrap();
        assert!(me <= super::boot_ticks_now(), "this process started before now");
    }

    #[test]
    fn the_resident_bytes_of_bpf_map_mappings_are_summed_from_smaps() {
        let smaps = "\
7f0000000000-7f0000001000 rw-s 00000000 00:0e 1234                       anon_inode:bpf-map
Size:                  4 kB
Rss:                   4 kB
VmFlags: rd wr sh mr mw me ms sd
7f0000001000-7f0000203000 r--s 00001000 00:0e 1234                       anon_inode:bpf-map
Size:               2056 kB
Rss:                2056 kB
7f0000203000-7f0000304000 rw-p 00000000 00:00 0 
Size:               1028 kB
Rss:                 512 kB
55d000000000-55d000100000 r-xp 00000000 08:01 42                         /usr/bin/memtrace
Rss:                 900 kB
";
        assert_eq!(bpf_mapped_rss(smaps), (4 + 2056) * 1024);
        assert_eq!(bpf_mapped_rss(""), 0);
    }

    use super::*;

    const MAPS: &str = "\
55d0c6a00000-55d0c6a02000 r--p 00000000 fe:01 1234  /usr/bin/prog
55d0c6a02000-55d0c6a05000 r-xp 00002000 fe:01 1234  /usr/bin/prog
55d0c7000000-55d0c7021000 rw-p 00000000 00:00 0  [heap]
7f1e2a000000-7f1e2a028000 r--p 00000000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1e2a028000-7f1e2a19d000 r-xp 00028000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1e2b000000-7f1e2b001000 r-xp 00000000 fe:01 77 /tmp/my lib.so (deleted)
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
";

    #[test]
    fn parses_maps_with_spaces_and_deleted_files() {
        let maps = Maps::parse(MAPS);
        assert_eq!(maps.mappings.len(), 7);
        let lib = &maps.mappings[5];
        assert_eq!(lib.path, PathBuf::from("/tmp/my lib.so"));
        assert!(lib.deleted && lib.executable);
        assert_eq!(maps.file_mappings().count(), 5);
        let code = maps.find(0x7f1e2a030000).unwrap();
        assert_eq!(code.file_offset(0x7f1e2a030000), 0x30000);
        assert!(maps.find(0x7f1e2a19d000).is_none());
        assert_eq!(maps.find(0x55d0c7000010).unwrap().path, PathBuf::from("[heap]"));
    }

    #[test]
    fn reads_our_own_state() {
        let state = process_state(std::process::id()).unwrap();
        assert!(!state.kernel_thread);
        assert!(matches!(state.state, 'R' | 'S'));
    }
}
