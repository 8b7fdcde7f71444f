//! Multi-uprobe links (`BPF_TRACE_UPROBE_MULTI`, Linux 6.6): every probe one program has in
//! one file goes through a single link, created here with `bpf(BPF_LINK_CREATE)`. Closing
//! the link detaches them all at once, for one RCU grace period (Linux 6.12 and later)
//! instead of one per probe, which is what made `memtrace record -- true` take seconds.
//!
//! On Linux 6.13 and later the malloc family's entry and return go through one uprobe
//! session link (`BPF_TRACE_UPROBE_SESSION`) instead of two: the entry program says
//! whether the return needs to run, and the kernel plants no return probe for the calls
//! that do not (an unsampled call costs one trap, not two).
//!
//! The program must have been loaded for the link's attach type
//! (`UProbe::load_with_expected_attach_type`, vendored aya). Older kernels, or
//! `MEMTRACE_UPROBE_ATTACH=multi|perf`, use plain multi links or aya's
//! one-perf-event-per-probe path instead ([`AttachPath`]).
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// `BPF_LINK_CREATE` in `enum bpf_cmd`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_TRACE_UPROBE_MULTI` in `enum bpf_attach_type`.
pub const BPF_TRACE_UPROBE_MULTI: u32 = 48;
/// `BPF_TRACE_UPROBE_SESSION` in `enum bpf_attach_type` (Linux 6.13).
pub const BPF_TRACE_UPROBE_SESSION: u32 = 57;
/// `BPF_F_UPROBE_MULTI_RETURN`: the link's probes are return probes.
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// The `link_create` member of `union bpf_attr` with its `uprobe_multi` arm, as the kernel
/// lays it out (`include/uapi/linux/bpf.h`). The kernel accepts an attr shorter than its
/// own union as long as what it reads lies inside.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct LinkCreateUprobeMulti {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// How the uprobes of a session are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachPath {
    /// As `Multi`, but the allocating functions' entry and return run one session program
    /// (`alloc_session`) through a `BPF_TRACE_UPROBE_SESSION` link.
    Session,
    /// One `BPF_TRACE_UPROBE_MULTI` link per program and file.
    Multi,
    /// One perf event per probe (kernels before 6.6): each detach waits for its own RCU
    /// grace period, so detaching is done on parallel threads.
    PerfEvents,
}

impl AttachPath {
    /// The best path this kernel offers, unless `MEMTRACE_UPROBE_ATTACH` asks for an older
    /// one (`multi`: no sessions; `perf`: one perf event per probe; the fallbacks are
    /// tested that way).
    pub fn choose() -> Self {
        let asked = std::env::var("MEMTRACE_UPROBE_ATTACH").unwrap_or_default();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        Self::for_kernel(&release, &asked)
    }

    /// The path for kernel `release` when `asked` (`""`, `multi` or `perf`).
    pub fn for_kernel(release: &str, asked: &str) -> Self {
        let best = if kernel_at_least(release, (6, 13)) {
            Self::Session
        } else if kernel_at_least(release, (6, 6)) {
            Self::Multi
        } else {
            Self::PerfEvents
        };
        match asked {
            "perf" => Self::PerfEvents,
            "multi" if best == Self::Session => Self::Multi,
            _ => best,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Session => "uprobe_multi links, one uprobe session link per file",
            Self::Multi => "uprobe_multi links",
            Self::PerfEvents => "one perf event per probe",
        }
    }

    /// Whether uprobes attach through links created here (session or multi), which need
    /// their programs loaded for the link's attach type.
    pub fn uses_links(self) -> bool {
        self != Self::PerfEvents
    }
}

/// Whether a kernel release string (`6.18.44-foo`) is at least `(major, minor)`.
pub fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok()).unwrap_or(0);
    major.is_some_and(|major| (major, minor) >= want)
}

/// An attached multi-uprobe link; dropping it detaches every probe it holds.
#[derive(Debug)]
pub struct MultiLink {
    fd: OwnedFd,
    probes: usize,
}

impl MultiLink {
    pub fn probes(&self) -> usize {
        self.probes
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// When a link's program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// At the probed address.
    Entry,
    /// At the return of the function probed.
    Return,
    /// At the probed address and, when that run returned 0, at the return (a program
    /// loaded for `BPF_TRACE_UPROBE_SESSION`).
    Session,
}

/// What one link attaches: `program` at every file offset of `path` (with the cookie of the
/// same index), run as `kind` says, for one process (`pid`, its threads included) or for
/// every process mapping the file (`pid` None).
pub struct MultiSpec<'a> {
    pub path: &'a Path,
    pub offsets: &'a [u64],
    pub cookies: &'a [u64],
    pub pid: Option<u32>,
    pub kind: LinkKind,
}

/// Creates the link.
pub fn attach(program: BorrowedFd<'_>, spec: &MultiSpec<'_>) -> io::Result<MultiLink> {
    if spec.offsets.is_empty() || spec.offsets.len() != spec.cookies.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "one cookie per offset, at least one offset"));
    }
    let path = CString::new(spec.path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    let attr = LinkCreateUprobeMulti {
        prog_fd: program.as_raw_fd() as u32,
        attach_type: if spec.kind == LinkKind::Session { BPF_TRACE_UPROBE_SESSION } else { BPF_TRACE_UPROBE_MULTI },
        path: path.as_ptr() as u64,
        offsets: spec.offsets.as_ptr() as u64,
        cookies: spec.cookies.as_ptr() as u64,
        cnt: spec.offsets.len() as u32,
        multi_flags: if spec.kind == LinkKind::Return { BPF_F_UPROBE_MULTI_RETURN } else { 0 },
        pid: spec.pid.unwrap_or(0),
        ..Default::default()
    };
    // SAFETY: `attr` is a valid link_create attr whose pointers (path, offsets, cookies)
    // stay alive for the call; the kernel copies what it needs before returning.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreateUprobeMulti,
            size_of::<LinkCreateUprobeMulti>() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: BPF_LINK_CREATE returned a new descriptor, now owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    Ok(MultiLink { fd, probes: spec.offsets.len() })
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    #[test]
    fn the_attr_has_the_kernel_layout() {
        assert_eq!(offset_of!(LinkCreateUprobeMulti, attach_type), 8);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, flags), 12);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, path), 16);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, offsets), 24);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, ref_ctr_offsets), 32);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, cookies), 40);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, cnt), 48);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, multi_flags), 52);
        assert_eq!(offset_of!(LinkCreateUprobeMulti, pid), 56);
    }

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        assert!(kernel_at_least("6.18.44-fc-v782", (6, 6)));
        assert!(kernel_at_least("6.6.0", (6, 6)));
        assert!(kernel_at_least("7.0.1", (6, 6)));
        assert!(!kernel_at_least("6.5.13-generic", (6, 6)));
        assert!(!kernel_at_least("5.15.0", (6, 6)));
        assert!(!kernel_at_least("garbage", (6, 6)));
    }

    #[test]
    fn the_path_is_the_best_the_kernel_has_unless_an_older_one_is_asked_for() {
        assert_eq!(AttachPath::for_kernel("6.18.44-fc", ""), AttachPath::Session);
        assert_eq!(AttachPath::for_kernel("6.13.0", ""), AttachPath::Session);
        assert_eq!(AttachPath::for_kernel("6.12.9", ""), AttachPath::Multi);
        assert_eq!(AttachPath::for_kernel("6.6.0", ""), AttachPath::Multi);
        assert_eq!(AttachPath::for_kernel("6.1.0", ""), AttachPath::PerfEvents);
        assert_eq!(AttachPath::for_kernel("6.18.44", "multi"), AttachPath::Multi);
        assert_eq!(AttachPath::for_kernel("6.18.44", "perf"), AttachPath::PerfEvents);
        // Asking for more than the kernel has gives what it has.
        assert_eq!(AttachPath::for_kernel("6.8.0", "multi"), AttachPath::Multi);
        assert_eq!(AttachPath::for_kernel("5.15.0", "multi"), AttachPath::PerfEvents);
        assert_eq!(AttachPath::for_kernel("6.18.44", "garbage"), AttachPath::Session);
    }

    #[test]
    fn bad_specs_are_refused_before_the_kernel_sees_them() {
        let devnull = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd as _;
        let spec = MultiSpec {
            path: Path::new("/bin/true"),
            offsets: &[1, 2],
            cookies: &[1],
            pid: None,
            kind: LinkKind::Entry,
        };
        assert_eq!(attach(devnull.as_fd(), &spec).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        let spec =
            MultiSpec { path: Path::new("/bin/true"), offsets: &[], cookies: &[], pid: None, kind: LinkKind::Session };
        assert_eq!(attach(devnull.as_fd(), &spec).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
