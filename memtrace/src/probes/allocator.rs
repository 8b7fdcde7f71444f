//! Finding the allocators a process really calls. Its `malloc` is found the way the dynamic
//! linker would: the executable, then LD_PRELOAD, then DT_NEEDED libraries breadth-first;
//! the first object defining `{prefix}malloc` and `{prefix}free` wins (a statically linked
//! malloc is found in the executable itself). That object's family (glibc, jemalloc,
//! mimalloc, tcmalloc, musl) is recognised by its symbol set, which says which functions to
//! probe (its own C++ operators included) and how usable sizes are known. Any module may
//! also carry a prefixed jemalloc (`je_`, `_rjem_`, `duckdb_je_`, ...), found by its
//! `{p}mallocx`/`{p}sdallocx`/`{p}mallctl` siblings, or a mimalloc under its own names
//! (`mi_malloc_aligned`, `mi_free`: Rust's `mimalloc` crate). `mmap`/`munmap` come from
//! whichever object defines them (libc).
//!
//! Over 500 lines: each allocator family's symbol set and the dynamic linker's lookup order are read together; tests from line 601.
use std::{
    collections::{HashMap, HashSet, VecDeque},
    env, fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use memtrace_common::Kind;

use crate::{
    elf::{ElfFile, Function},
    probes::placement,
    procfs,
    sizes::Family,
};
use iced_x86::Register;

/// The argument registers the probes read for each kind of function.
fn argument_registers(kind: Kind) -> &'static [Register] {
    match kind {
        Kind::Malloc | Kind::Valloc | Kind::Pvalloc | Kind::Free | Kind::New => &[Register::RDI],
        Kind::Calloc | Kind::Realloc | Kind::Munmap | Kind::NewAligned | Kind::Mallocx => {
            &[Register::RDI, Register::RSI]
        }
        Kind::ReallocArray => &[Register::RDI, Register::RSI, Register::RDX],
        Kind::PosixMemalign => &[Register::RDI, Register::RDX],
        Kind::AlignedAlloc | Kind::Memalign => &[Register::RSI],
        // Length, protection, flags (the probe tells a file's mapping by them).
        Kind::Mmap => &[Register::RSI, Register::RDX, Register::RCX],
        // Old address, old length, new length, flags.
        Kind::Mremap => &[Register::RDI, Register::RSI, Register::RDX, Register::RCX],
        _ => &[Register::RDI, Register::RSI, Register::RDX],
    }
}

/// Where one uprobe goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachPoint {
    pub path: PathBuf,
    /// The function's file offset.
    pub offset: u64,
    /// Where in the function the probes go (see `placement`): the first instruction the
    /// kernel emulates, when reaching it changes nothing the probes read.
    pub probe_offset: u64,
    pub kind: Kind,
    /// Every symbol at this address (aliases such as `memalign`/`aligned_alloc`).
    pub symbols: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocator {
    /// The object whose malloc family is probed.
    pub object: PathBuf,
    /// The object's (device, inode): the same file under different paths is one allocator.
    pub file_id: (u64, u64),
    /// glibc's malloc: `malloc_usable_size` can be read from chunk headers.
    pub glibc: bool,
    /// Which allocator this is.
    pub family: Family,
    /// The prefix of its function names ("" for the C names).
    pub prefix: String,
    /// The index its records carry (`UserAllocRecord::allocator`), set by the session.
    pub index: u8,
    /// mimalloc 2.0 with the release layout (Debian's `libmimalloc.so.2.0`): the probes
    /// read aligned blocks' usable size from its page metadata.
    pub mimalloc_pages: bool,
    /// Found in (or for) a traced program; false for an installed allocator library probed
    /// ahead of time, in case a program exec'd later preloads it.
    pub found: bool,
    pub points: Vec<AttachPoint>,
}

impl Allocator {
    /// The function that allocates through this allocator most plainly (for benchmarks).
    pub fn describe(&self) -> String {
        let prefix = if self.prefix.is_empty() { String::new() } else { format!(", prefix {}", self.prefix) };
        format!("{} ({}{prefix})", self.object.display(), self.family.name())
    }
}

/// Entry points beyond the C names, per family: what must be probed so that every call the
/// program makes is seen once (the research behind each list: which of them call which).
fn family_extras(family: Family) -> &'static [(&'static str, Kind)] {
    match family {
        // `_Znam*` jump to these; aligned new calls aligned_alloc; unsized deletes jump to
        // free, sized aligned ones to sdallocx; sized deletes have their own code.
        Family::Jemalloc => &[
            ("mallocx", Kind::Mallocx),
            ("rallocx", Kind::Rallocx),
            ("_Znwm", Kind::New),
            ("_ZnwmRKSt9nothrow_t", Kind::New),
            ("dallocx", Kind::Free),
            ("sdallocx", Kind::Free),
            ("_ZdlPvm", Kind::Free),
            ("_ZdaPvm", Kind::Free),
        ],
        // Every delete is free's address or a stub jumping to mi_free.
        Family::Mimalloc => &[
            ("_Znwm", Kind::New),
            ("_Znam", Kind::New),
            ("_ZnwmRKSt9nothrow_t", Kind::New),
            ("_ZnamRKSt9nothrow_t", Kind::New),
            ("_ZnwmSt11align_val_t", Kind::NewAligned),
            ("_ZnamSt11align_val_t", Kind::NewAligned),
            ("_ZnwmSt11align_val_tRKSt9nothrow_t", Kind::NewAligned),
            ("_ZnamSt11align_val_tRKSt9nothrow_t", Kind::NewAligned),
        ],
        // New and five of the six delete flavours are functions of their own.
        Family::Tcmalloc => &[
            ("_Znwm", Kind::New),
            ("_Znam", Kind::New),
            ("_ZnwmRKSt9nothrow_t", Kind::New),
            ("_ZnamRKSt9nothrow_t", Kind::New),
            ("_ZnwmSt11align_val_t", Kind::NewAligned),
            ("_ZnamSt11align_val_t", Kind::NewAligned),
            ("_ZnwmSt11align_val_tRKSt9nothrow_t", Kind::NewAligned),
            ("_ZnamSt11align_val_tRKSt9nothrow_t", Kind::NewAligned),
            ("_ZdlPvm", Kind::Free),
            ("_ZdaPvm", Kind::Free),
            ("_ZdlPvRKSt9nothrow_t", Kind::Free),
            ("_ZdaPvRKSt9nothrow_t", Kind::Free),
            ("_ZdlPvSt11align_val_t", Kind::Free),
            ("_ZdaPvSt11align_val_t", Kind::Free),
            ("_ZdlPvmSt11align_val_t", Kind::Free),
            ("_ZdaPvmSt11align_val_t", Kind::Free),
            ("_ZdlPvSt11align_val_tRKSt9nothrow_t", Kind::Free),
            ("_ZdaPvSt11align_val_tRKSt9nothrow_t", Kind::Free),
        ],
        Family::Glibc | Family::Musl | Family::Unknown => &[],
    }
}

/// The family of the object defining `{prefix}malloc` and `{prefix}free`, by its symbols.
/// `__libc_malloc` alone does not mean glibc: mimalloc and tcmalloc export it too.
pub fn classify(names: &dyn Fn(&str) -> bool, prefix: &str) -> Family {
    let has = |n: &str| names(&format!("{prefix}{n}"));
    if has("mallocx") && has("sdallocx") && has("mallctl") {
        Family::Jemalloc
    } else if !prefix.is_empty() {
        Family::Unknown
    } else if names("__libc_malloc") && (names("gnu_get_libc_version") || names("malloc_trim") || names("mallinfo2")) {
        Family::Glibc
    } else if names("mi_malloc") && names("mi_free") {
        Family::Mimalloc
    } else if names("tc_malloc") && names("tc_free") {
        Family::Tcmalloc
    } else if names("__libc_malloc_impl") || names("__malloc_context") {
        Family::Musl
    } else if names("jemalloc_constructor") || names("jemalloc_postfork_child") {
        // jemalloc linked in without its own API exported (rustc, through tikv-jemalloc-sys:
        // only the C names), known by its functions in the symbol table.
        Family::Jemalloc
    } else {
        Family::Unknown
    }
}

#[cfg(test)]
mod classify_tests {
    use super::*;

    fn family(symbols: &[&str], prefix: &str) -> Family {
        classify(&|n| symbols.contains(&n), prefix)
    }

    #[test]
    fn a_family_is_told_by_its_symbols() {
        let glibc = ["malloc", "free", "__libc_malloc", "malloc_trim"];
        assert_eq!(family(&glibc, ""), Family::Glibc);
        assert_eq!(family(&["je_mallocx", "je_sdallocx", "je_mallctl"], "je_"), Family::Jemalloc);
        assert_eq!(family(&["malloc", "free", "mi_malloc", "mi_free", "__libc_malloc"], ""), Family::Mimalloc);
        // rustc's binary: the C names, and jemalloc's own functions in .symtab only.
        let rustc = ["malloc", "free", "malloc_usable_size", "jemalloc_constructor", "jemalloc_postfork_child"];
        assert_eq!(family(&rustc, ""), Family::Jemalloc);
        assert_eq!(family(&["malloc", "free"], ""), Family::Unknown);
        assert_eq!(family(&["my_malloc", "my_free", "jemalloc_constructor"], "my_"), Family::Unknown);
    }
}

/// The prefixes of the jemallocs an object defines besides its C names: every `{p}mallocx`
/// with `{p}sdallocx`, `{p}mallctl`, `{p}malloc` and `{p}free` beside it.
pub fn jemalloc_prefixes(names: &HashMap<String, Function>) -> Vec<String> {
    let mut prefixes: Vec<String> = names
        .keys()
        .filter_map(|n| n.strip_suffix("mallocx"))
        .filter(|p| !p.is_empty())
        .filter(|p| ["sdallocx", "mallctl", "malloc", "free"].iter().all(|f| names.contains_key(&format!("{p}{f}"))))
        .map(str::to_string)
        .collect();
    prefixes.sort();
    prefixes
}

/// The probes of one family of functions named `{prefix}...` in `elf`.
fn family_points(
    elf: &ElfFile,
    path: &Path,
    functions: &HashMap<String, Function>,
    family: Family,
    prefix: &str,
) -> Vec<AttachPoint> {
    let named: Vec<(String, Function, Kind)> = FAMILY
        .iter()
        .chain(family_extras(family))
        .filter_map(|(n, k)| {
            let name = format!("{prefix}{n}");
            functions.get(&name).map(|&o| (name, o, *k))
        })
        .collect();
    group_by_offset(elf, path, named)
}

/// The malloc family, in the order that names a shared address (glibc 2.36 makes
/// `aligned_alloc` an alias of `memalign`; the first name wins).
const FAMILY: &[(&str, Kind)] = &[
    ("malloc", Kind::Malloc),
    ("calloc", Kind::Calloc),
    ("realloc", Kind::Realloc),
    ("reallocarray", Kind::ReallocArray),
    ("posix_memalign", Kind::PosixMemalign),
    ("memalign", Kind::Memalign),
    ("aligned_alloc", Kind::AlignedAlloc),
    ("valloc", Kind::Valloc),
    ("pvalloc", Kind::Pvalloc),
    ("free", Kind::Free),
];

const MAPPING: &[(&str, Kind)] =
    &[("mmap", Kind::Mmap), ("mmap64", Kind::Mmap), ("munmap", Kind::Munmap), ("mremap", Kind::Mremap)];

/// Picks the allocator among `candidates` (in symbol-lookup order).
pub fn resolve(candidates: &[PathBuf], prefix: &str) -> Result<Allocator> {
    let mut allocator = None;
    let mut mapping_points = None;
    for path in candidates {
        let Ok(elf) = ElfFile::open(path) else {
            continue;
        };
        if allocator.is_none() {
            let malloc = format!("{prefix}malloc");
            let free = format!("{prefix}free");
            let pair = elf.function_offsets(&[&malloc, &free])?;
            if pair.contains_key(&malloc) && pair.contains_key(&free) {
                let functions = elf.functions()?;
                let family = classify(&|n| functions.contains_key(n), prefix);
                let points = family_points(&elf, path, &functions, family, prefix);
                allocator = Some((path.clone(), family, points));
            }
        }
        if mapping_points.is_none() {
            let names: Vec<&str> = MAPPING.iter().map(|(n, _)| *n).collect();
            let offsets = elf.function_offsets(&names)?;
            if offsets.contains_key("mmap") && offsets.contains_key("munmap") {
                let named =
                    MAPPING.iter().filter_map(|(n, k)| offsets.get(*n).map(|&o| (n.to_string(), o, *k))).collect();
                mapping_points = Some(group_by_offset(&elf, path, named));
            }
        }
        if allocator.is_some() && mapping_points.is_some() {
            break;
        }
    }
    let Some((object, family, mut points)) = allocator else {
        bail!(
            "no {prefix}malloc and {prefix}free found in {} (statically linked without symbols, or a custom allocator: try --symbol-prefix)",
            candidates.first().map(|p| p.display().to_string()).unwrap_or_default()
        );
    };
    points.extend(mapping_points.unwrap_or_default());
    let mimalloc_pages = family == Family::Mimalloc && is_mimalloc_2_0(&object);
    Ok(Allocator {
        file_id: file_id(&object),
        object,
        glibc: family == Family::Glibc,
        family,
        prefix: prefix.to_string(),
        index: 0,
        mimalloc_pages,
        found: true,
        points,
    })
}

/// The allocator libraries installed on this machine that programs commonly preload
/// (Debian's jemalloc, mimalloc and tcmalloc packages): probed ahead of time when following
/// a command, so that `env LD_PRELOAD=... prog` is traced from its first call.
pub fn installed_libraries() -> Vec<Allocator> {
    const NAMES: [&str; 4] = ["libjemalloc.so.2", "libmimalloc.so.2", "libtcmalloc_minimal.so.4", "libtcmalloc.so.4"];
    let dirs = system_library_dirs();
    let mut found: Vec<Allocator> = Vec::new();
    for name in NAMES {
        let Some(path) = dirs.iter().map(|d| d.join(name)).find(|p| p.is_file()) else { continue };
        if let Ok(mut a) = resolve(std::slice::from_ref(&path), "")
            && a.family != Family::Unknown
            && !found.iter().any(|f| f.file_id == a.file_id)
        {
            // (tcmalloc's own mmap/munmap stay: a program preloading it calls them)
            a.found = false;
            found.push(a);
        }
    }
    found
}

/// Whether `object` is a shared mimalloc of the 2.0 series (its file is named
/// `libmimalloc.so.2.0`, `libmimalloc.so.2.0.9`, ...; 2.1 changed the page layout).
fn is_mimalloc_2_0(object: &Path) -> bool {
    let real = fs::canonicalize(object).unwrap_or_else(|_| object.to_path_buf());
    real.file_name().is_some_and(|n| {
        let n = n.to_string_lossy();
        n == "libmimalloc.so.2.0" || n.starts_with("libmimalloc.so.2.0.")
    })
}

/// The prefixed jemallocs in `objects` (no flag needed: found by their symbol sets).
pub fn prefixed(objects: &[PathBuf]) -> Vec<Allocator> {
    let mut found = Vec::new();
    for path in objects {
        let Ok(elf) = ElfFile::open(path) else { continue };
        // Most libraries have no `…mallocx` and no `mi_free`: only those with one are read
        // whole.
        let Ok(candidates) = elf.function_names_where(|n| n.ends_with("mallocx") || n == "mi_free" || n == "malloc")
        else {
            continue;
        };
        let has = |name: &str| candidates.iter().any(|n| n == name);
        if has("mi_free")
            && !has("malloc")
            && let Some(mimalloc) = linked_mimalloc(&elf, path)
        {
            found.push(mimalloc);
        }
        let prefixes: Vec<&str> =
            candidates.iter().filter_map(|n| n.strip_suffix("mallocx")).filter(|p| !p.is_empty()).collect();
        if prefixes.is_empty() {
            continue;
        }
        // Only the functions that may belong to those prefixes.
        let Ok(functions) = elf.functions_starting_with(&prefixes) else { continue };
        for prefix in jemalloc_prefixes(&functions) {
            let points = family_points(&elf, path, &functions, Family::Jemalloc, &prefix);
            found.push(Allocator {
                file_id: file_id(path),
                object: path.clone(),
                glibc: false,
                family: Family::Jemalloc,
                prefix,
                index: 0,
                mimalloc_pages: false,
                found: true,
                points,
            });
        }
    }
    found
}

/// mimalloc's own entry points, for a mimalloc linked into an object without taking over
/// `malloc` (Rust's `mimalloc` crate: its global allocator calls `mi_malloc_aligned`,
/// `mi_zalloc_aligned`, `mi_realloc_aligned` and `mi_free`, and the linker keeps only
/// those). Each allocating one takes the size first, as `malloc`; each reallocating one the
/// block then the size, as `realloc`. None of them calls another (they go through the
/// `mi_heap_*` functions), but `mi_free` inside a reallocation, as in the shared library.
const MIMALLOC_OWN: &[(&str, Kind)] = &[
    ("mi_malloc", Kind::Malloc),
    ("mi_zalloc", Kind::Malloc),
    ("mi_calloc", Kind::Calloc),
    ("mi_realloc", Kind::Realloc),
    ("mi_malloc_aligned", Kind::Malloc),
    ("mi_zalloc_aligned", Kind::Malloc),
    ("mi_realloc_aligned", Kind::Realloc),
    ("mi_free", Kind::Free),
];

/// The mimalloc linked into `path` under its own names (see [`MIMALLOC_OWN`]), if it has
/// `mi_free` and an allocating entry point.
fn linked_mimalloc(elf: &ElfFile, path: &Path) -> Option<Allocator> {
    let functions = elf.functions_starting_with(&["mi_"]).ok()?;
    let named: Vec<(String, Function, Kind)> =
        MIMALLOC_OWN.iter().filter_map(|&(n, k)| functions.get(n).map(|&f| (n.to_string(), f, k))).collect();
    if !named.iter().any(|(_, _, k)| *k != Kind::Free) || !functions.contains_key("mi_free") {
        return None;
    }
    Some(Allocator {
        file_id: file_id(path),
        object: path.to_path_buf(),
        glibc: false,
        family: Family::Mimalloc,
        prefix: "mi_".into(),
        index: 0,
        mimalloc_pages: false,
        found: true,
        points: group_by_offset(elf, path, named),
    })
}

/// (device, inode) of a file, following symlinks (and /proc/PID/root).
pub fn file_id(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata(path).map(|m| (m.dev(), m.ino())).unwrap_or((0, 0))
}

/// memtrace's own executable, whose allocator (the mimalloc linked into it) is never probed
/// for every process: uprobes go into the file, so this process would trap on each of its
/// own allocations (another memtrace started beside `record -a`, `top` or `serve -a` is
/// otherwise found and probed like any program).
pub fn is_own_executable(file_id: (u64, u64)) -> bool {
    static OWN: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
    file_id != (0, 0) && file_id == *OWN.get_or_init(|| self::file_id(Path::new("/proc/self/exe")))
}

/// One attach point per address, named by the first function in list order, with its
/// probe placed past instructions the kernel would single-step.
fn group_by_offset(elf: &ElfFile, path: &Path, named: Vec<(String, Function, Kind)>) -> Vec<AttachPoint> {
    let mut points: Vec<AttachPoint> = Vec::new();
    for (name, function, kind) in named {
        match points.iter_mut().find(|p| p.offset == function.offset) {
            Some(point) => point.symbols.push(name),
            None => {
                let len = (function.size > 0).then_some(function.size as usize);
                let code = elf.bytes(function.offset, len.unwrap_or(64).min(64 << 10));
                let probe_offset = placement::probe_offset(code, len, argument_registers(kind));
                points.push(AttachPoint {
                    path: path.to_path_buf(),
                    offset: function.offset,
                    probe_offset,
                    kind,
                    symbols: vec![name],
                });
            }
        }
    }
    points
}

/// Directories the dynamic linker searches after RUNPATH: ld.so.conf, then the defaults.
fn system_library_dirs() -> Vec<PathBuf> {
    system_library_dirs_in(Path::new("/"))
}

/// The library directories of the file system seen from `root` (a chrooted or contained
/// process's `/proc/PID/root`), as paths from ours.
fn system_library_dirs_in(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    read_ld_so_conf(root, &root.join("etc/ld.so.conf"), &mut dirs, 0);
    for d in ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib"] {
        dirs.push(root.join(d));
    }
    dirs
}

/// `path` as seen from `root`: absolute paths are taken from it (a path already under it
/// is left as it is).
fn under(root: &Path, path: &Path) -> PathBuf {
    if path.starts_with(root) { path.to_path_buf() } else { root.join(path.strip_prefix("/").unwrap_or(path)) }
}

/// The root a path of `/proc/PID/root/…` (a process whose root is not ours: a chroot, a
/// container) is under; `/` for any other path.
fn root_of(path: &Path) -> PathBuf {
    let mut parts = path.components().skip(1);
    match (parts.next(), parts.next(), parts.next()) {
        (Some(proc), Some(pid), Some(root))
            if proc.as_os_str() == "proc"
                && pid.as_os_str().to_str().is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()))
                && root.as_os_str() == "root" =>
        {
            Path::new("/proc").join(pid).join("root")
        }
        _ => PathBuf::from("/"),
    }
}

/// Where the dynamic linker of a process whose root is `root` finds library `name`: as
/// [`search_dirs`] does for ours, but in that file system (and without our
/// `LD_LIBRARY_PATH`).
fn search_dirs_in(root: &Path, name: &str, runpath: &[PathBuf]) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(under(root, Path::new(name)));
    }
    runpath
        .iter()
        .map(|d| under(root, d))
        .chain(system_library_dirs_in(root))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn read_ld_so_conf(root: &Path, path: &Path, dirs: &mut Vec<PathBuf>, depth: usize) {
    let Ok(text) = fs::read_to_string(path) else {
        return;
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include") {
            let pattern = under(root, Path::new(pattern.trim()));
            let (Some(dir), Some(file_pattern)) = (pattern.parent(), pattern.file_name()) else {
                continue;
            };
            let file_pattern = file_pattern.to_string_lossy();
            let suffix = file_pattern.trim_start_matches('*');
            let Ok(entries) = fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(suffix))
                .collect();
            files.sort();
            if depth < 4 {
                for file in files {
                    read_ld_so_conf(root, &file, dirs, depth + 1);
                }
            }
        } else if line.starts_with('/') {
            dirs.push(under(root, Path::new(line)));
        }
    }
}

/// Objects a program will search for symbols, in the dynamic linker's order, found through
/// `locate` (name → path) for each DT_NEEDED name.
fn lookup_order(exe: &Path, preload: &[PathBuf], locate: &dyn Fn(&str, &[PathBuf]) -> Option<PathBuf>) -> Vec<PathBuf> {
    let mut order = vec![exe.to_path_buf()];
    order.extend(preload.iter().cloned());
    let mut seen: HashSet<PathBuf> = order.iter().cloned().collect();
    let mut queue: VecDeque<PathBuf> = order.iter().cloned().collect();
    while let Some(object) = queue.pop_front() {
        let Ok(elf) = ElfFile::open(&object) else {
            continue;
        };
        let Ok((needed, runpath)) = elf.dynamic_deps() else {
            continue;
        };
        let origin = object.parent().unwrap_or(Path::new("/")).to_string_lossy().into_owned();
        let runpath: Vec<PathBuf> = runpath
            .iter()
            .map(|d| PathBuf::from(d.replace("$ORIGIN", &origin).replace("${ORIGIN}", &origin)))
            .collect();
        for name in needed {
            if let Some(path) = locate(&name, &runpath)
                && seen.insert(path.clone())
            {
                order.push(path.clone());
                queue.push_back(path);
            }
        }
    }
    order
}

fn search_dirs(name: &str, runpath: &[PathBuf]) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    let ld_library_path = env::var("LD_LIBRARY_PATH").unwrap_or_default();
    ld_library_path
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .chain(runpath.iter().cloned())
        .chain(system_library_dirs())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The program the kernel runs for `path`: a script's interpreter, named by its `#!` line
/// (through up to 4 scripts, as the kernel's `binfmt_script`), else `path` itself. What
/// the interpreter then execs (`#!/usr/bin/env python3`, a pyenv shim) is followed as any
/// exec of a traced process.
pub fn program_behind(path: &Path) -> PathBuf {
    use std::io::Read as _;
    let mut program = path.to_path_buf();
    for _ in 0..4 {
        let mut head = [0u8; 256];
        let n = fs::File::open(&program).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
        let Some(line) = head[..n].strip_prefix(b"#!") else { break };
        let line = &line[..line.iter().position(|&b| b == b'\n').unwrap_or(line.len())];
        let Some(interpreter) = String::from_utf8_lossy(line).split_whitespace().next().map(PathBuf::from) else {
            break;
        };
        program = interpreter;
    }
    program
}

/// The files a program at `exe` maps when exec'd with our environment: itself, its
/// interpreter, what it preloads and every library it needs, in lookup order.
pub fn program_files(exe: &Path) -> Vec<PathBuf> {
    let preload: Vec<PathBuf> = env::var("LD_PRELOAD")
        .unwrap_or_default()
        .split([':', ' '])
        .filter(|s| !s.is_empty())
        .filter_map(|s| search_dirs(s, &[]))
        .collect();
    let exe = &program_behind(exe);
    let mut files = lookup_order(exe, &preload, &search_dirs);
    if let Some(interp) = ElfFile::open(exe).ok().and_then(|e| e.interpreter()) {
        files.push(PathBuf::from(interp));
    }
    files
}

/// The allocator a program at `exe` will use once exec'd with our environment.
pub fn for_executable(exe: &Path, prefix: &str) -> Result<Allocator> {
    Ok(all_for_executable(exe, None, prefix)?.remove(0))
}

/// Every allocator a program at `exe` will have once exec'd with `preload` (LD_PRELOAD's
/// entries; None: ours): the one its `malloc` binds to first, then prefixed ones.
pub fn all_for_executable(exe: &Path, preload: Option<&[PathBuf]>, prefix: &str) -> Result<Vec<Allocator>> {
    all_for_executable_in(exe, &root_of(exe), preload, prefix)
}

/// [`all_for_executable`] for a process whose root directory is `root` (`/`: ours): a
/// program run in a chroot or a container (`/proc/PID/root`) loads its libraries from its
/// own file system, where a copy of the C library is another file, which the probes of
/// ours do not see.
pub fn all_for_executable_in(
    exe: &Path,
    root: &Path,
    preload: Option<&[PathBuf]>,
    prefix: &str,
) -> Result<Vec<Allocator>> {
    let ours = env::var("LD_PRELOAD").unwrap_or_default();
    let names: Vec<PathBuf> = match preload {
        Some(p) => p.to_vec(),
        None => ours.split([':', ' ']).filter(|s| !s.is_empty()).map(PathBuf::from).collect(),
    };
    if root != Path::new("/") {
        let locate = |name: &str, runpath: &[PathBuf]| search_dirs_in(root, name, runpath);
        let preload: Vec<PathBuf> = names.iter().filter_map(|s| locate(&s.to_string_lossy(), &[])).collect();
        // A script's interpreter is named in its file system; the program itself as given.
        let program = program_behind(exe);
        let program = if program == exe { program } else { under(root, &program) };
        let order = lookup_order(&program, &preload, &locate);
        return Ok(with_prefixed(resolve(&order, prefix)?, &order));
    }
    let preload: Vec<PathBuf> = names.iter().filter_map(|s| search_dirs(&s.to_string_lossy(), &[])).collect();
    let order = lookup_order(&program_behind(exe), &preload, &search_dirs);
    Ok(with_prefixed(resolve(&order, prefix)?, &order))
}

/// The primary allocator, then the prefixed jemallocs of `order` that are not it.
fn with_prefixed(primary: Allocator, order: &[PathBuf]) -> Vec<Allocator> {
    let mut all = vec![primary];
    for other in prefixed(order) {
        if !all.iter().any(|a| a.file_id == other.file_id && a.prefix == other.prefix) {
            all.push(other);
        }
    }
    all
}

/// The allocator a running process uses, from what it has mapped.
pub fn for_process(pid: u32, prefix: &str) -> Result<Allocator> {
    Ok(all_for_process(pid, prefix)?.remove(0))
}

/// Every allocator a running process has, from what it has mapped: the one its `malloc`
/// binds to first, then prefixed ones.
pub fn all_for_process(pid: u32, prefix: &str) -> Result<Vec<Allocator>> {
    let maps = procfs::Maps::read(pid).with_context(|| format!("reading /proc/{pid}/maps"))?;
    let mapped: Vec<PathBuf> = {
        let mut seen = HashSet::new();
        maps.file_mappings()
            .filter(|m| m.executable)
            .map(|m| procfs::path_in_process(pid, &m.path))
            .filter(|p| seen.insert(p.clone()))
            .collect()
    };
    let exe = procfs::exe(pid).with_context(|| format!("reading /proc/{pid}/exe"))?;
    let exe = procfs::path_in_process(pid, &exe);
    // LD_PRELOAD names a file as given (often a symlink such as libtcmalloc_minimal.so.4);
    // the maps show the file it resolved to.
    let same_file = |given: &Path, m: &Path| {
        m.file_name() == given.file_name()
            || search_dirs(&given.to_string_lossy(), &[])
                .and_then(|g| fs::canonicalize(procfs::path_in_process(pid, &g)).ok())
                .is_some_and(|g| fs::canonicalize(m).ok().as_ref() == Some(&g))
    };
    let preload: Vec<PathBuf> =
        procfs::ld_preload(pid).iter().filter_map(|p| mapped.iter().find(|m| same_file(p, m)).cloned()).collect();
    let locate = |name: &str, runpath: &[PathBuf]| -> Option<PathBuf> {
        let base = Path::new(name).file_name()?;
        if let Some(m) = mapped.iter().find(|m| m.file_name() == Some(base)) {
            return Some(m.clone());
        }
        let found = search_dirs(name, runpath)?;
        let canonical = fs::canonicalize(&found).ok()?;
        mapped.iter().find(|m| fs::canonicalize(m).ok().as_ref() == Some(&canonical)).cloned()
    };
    let mut order = lookup_order(&exe, &preload, &locate);
    // Objects loaded later with dlopen come last.
    for m in &mapped {
        if !order.contains(m) {
            order.push(m.clone());
        }
    }
    // A process caught while the dynamic linker still maps its libraries: find them the way
    // the linker will (uprobes attach to files, so they fire once the library is mapped).
    match resolve(&order, prefix) {
        Ok(primary) => Ok(with_prefixed(primary, &order)),
        Err(e) => all_for_executable(&exe, Some(&procfs::ld_preload(pid)), prefix).map_err(|_| e),
    }
}

/// The C library the machine's programs use (for `record -a`): the one this process runs on.
pub fn system_libc(prefix: &str) -> Result<Allocator> {
    for_process(std::process::id(), prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program in a chroot or a container finds its libraries in its own file system:
    /// its standard directories, its `ld.so.conf` (includes followed there), names with a
    /// slash; a path under `/proc/PID/root` says which root it is.
    #[test]
    fn a_chrooted_programs_libraries_are_found_in_its_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for (file, text) in [
            ("lib/x86_64-linux-gnu/libfoo.so.1", "x"),
            ("opt/l/libbar.so", "x"),
            ("etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n"),
            ("etc/ld.so.conf.d/x.conf", "/opt/l\n"),
        ] {
            fs::create_dir_all(root.join(file).parent().unwrap()).unwrap();
            fs::write(root.join(file), text).unwrap();
        }
        let foo = root.join("lib/x86_64-linux-gnu/libfoo.so.1");
        assert_eq!(search_dirs_in(root, "libfoo.so.1", &[]), Some(foo.clone()));
        assert_eq!(search_dirs_in(root, "libbar.so", &[]), Some(root.join("opt/l/libbar.so")));
        assert_eq!(search_dirs_in(root, "/lib/x86_64-linux-gnu/libfoo.so.1", &[]), Some(foo.clone()));
        assert_eq!(search_dirs_in(root, "libfoo.so.1", &[PathBuf::from("/nowhere")]), Some(foo));
        assert_eq!(search_dirs_in(root, "libc.so.6", &[]), None, "not ours");
        assert_eq!(root_of(Path::new("/proc/42/root/usr/bin/x")), Path::new("/proc/42/root"));
        assert_eq!(root_of(Path::new("/proc/self/root/usr/bin/x")), Path::new("/"));
        assert_eq!(root_of(Path::new("/usr/bin/x")), Path::new("/"));
        assert_eq!(under(Path::new("/proc/42/root"), Path::new("/proc/42/root/a")), Path::new("/proc/42/root/a"));
    }

    #[test]
    fn our_own_process_uses_glibc_malloc_with_aliases_merged() {
        let alloc = for_process(std::process::id(), "").unwrap();
        assert!(alloc.glibc);
        assert!(alloc.object.to_string_lossy().contains("libc.so"));
        let kinds: Vec<Kind> = alloc.points.iter().map(|p| p.kind).collect();
        for kind in [Kind::Malloc, Kind::Calloc, Kind::Realloc, Kind::Free, Kind::Mmap, Kind::Munmap, Kind::Mremap] {
            assert!(kinds.contains(&kind), "{kind:?} missing from {kinds:?}");
        }
        // No address is probed twice, or its calls would count twice.
        let mut offsets: Vec<(&Path, u64)> = alloc.points.iter().map(|p| (p.path.as_path(), p.offset)).collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(offsets.len(), alloc.points.len());
    }

    #[test]
    fn probes_in_our_libc_sit_on_emulated_instructions_that_keep_the_arguments() {
        use iced_x86::{Decoder, DecoderOptions, Instruction, InstructionInfoFactory, OpAccess};
        let alloc = for_process(std::process::id(), "").unwrap();
        let elf = ElfFile::open(&alloc.object).unwrap();
        let mut moved = 0;
        for p in &alloc.points {
            let code = elf.bytes(p.offset, 64);
            let at = p.probe_offset as usize;
            // The probed instruction is emulated (or the probe stayed at the entry).
            let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
            let mut info = InstructionInfoFactory::new();
            let mut instr = Instruction::default();
            let mut offset = 0;
            while offset < at {
                decoder.decode_out(&mut instr);
                // Nothing skipped writes the stack pointer or an argument the probe reads.
                for used in info.info(&instr).used_registers() {
                    let reg = used.register().full_register();
                    let written = !matches!(used.access(), OpAccess::Read | OpAccess::CondRead | OpAccess::NoMemAccess);
                    assert!(
                        !(written && (reg == Register::RSP || argument_registers(p.kind).contains(&reg))),
                        "{:?} at +{offset} writes {reg:?}",
                        p.symbols
                    );
                }
                offset += instr.len();
            }
            assert_eq!(offset, at, "{:?}: the probe is on an instruction boundary", p.symbols);
            if at > 0 {
                decoder.decode_out(&mut instr);
                assert!(placement::is_emulated(&code[at..at + instr.len()]), "{:?}", p.symbols);
                moved += 1;
            }
        }
        // glibc's free begins with `test %rdi,%rdi`: its probe must have moved.
        let free = alloc.points.iter().find(|p| p.kind == Kind::Free).unwrap();
        if alloc.glibc {
            assert!(free.probe_offset > 0, "free's probe stayed at an instruction the kernel single-steps");
            assert!(moved >= 1);
        }
    }

    #[test]
    fn the_executable_path_resolves_to_the_same_libc() {
        let exe = std::env::current_exe().unwrap();
        let from_exe = for_executable(&exe, "").unwrap();
        let from_pid = for_process(std::process::id(), "").unwrap();
        assert_eq!(fs::canonicalize(&from_exe.object).unwrap(), fs::canonicalize(&from_pid.object).unwrap());
    }

    const LIBS: &str = "/usr/lib/x86_64-linux-gnu";

    fn library(name: &str) -> Option<Allocator> {
        let path = Path::new(LIBS).join(name);
        if !path.exists() {
            eprintln!("{} not installed (cargo xtask setup): skipped", path.display());
            return None;
        }
        Some(resolve(&[path], "").unwrap())
    }

    fn symbols(a: &Allocator, kind: Kind) -> Vec<String> {
        let mut names: Vec<String> =
            a.points.iter().filter(|p| p.kind == kind).flat_map(|p| p.symbols.iter().cloned()).collect();
        names.sort();
        names
    }

    #[test]
    fn each_debian_allocator_is_recognised_by_its_symbols_not_by_libc_malloc() {
        // mimalloc and tcmalloc export __libc_malloc too: neither is glibc.
        let libc = library("libc.so.6").unwrap();
        assert_eq!(libc.family, Family::Glibc);
        assert!(libc.glibc);
        assert!(symbols(&libc, Kind::New).is_empty(), "glibc serves no operator new");
        if let Some(je) = library("libjemalloc.so.2") {
            assert_eq!(je.family, Family::Jemalloc);
            assert!(!je.glibc);
            assert_eq!(symbols(&je, Kind::New), ["_Znwm", "_ZnwmRKSt9nothrow_t"]);
            assert_eq!(symbols(&je, Kind::Mallocx), ["mallocx"]);
            assert_eq!(symbols(&je, Kind::Rallocx), ["rallocx"]);
            // sized deletes have their own code; the other deletes jump to free or sdallocx
            assert_eq!(symbols(&je, Kind::Free), ["_ZdaPvm", "_ZdlPvm", "dallocx", "free", "sdallocx"]);
        }
        if let Some(mi) = library("libmimalloc.so.2") {
            assert_eq!(mi.family, Family::Mimalloc);
            assert!(!mi.glibc);
            assert!(mi.mimalloc_pages, "Debian's libmimalloc.so.2.0: aligned blocks read from its pages");
            assert!(symbols(&mi, Kind::New).contains(&"_Znwm".to_string()));
            assert!(symbols(&mi, Kind::NewAligned).contains(&"_ZnwmSt11align_val_t".to_string()));
            // every delete is free's address or jumps to mi_free
            assert_eq!(symbols(&mi, Kind::Free), ["free"]);
        }
        if let Some(tc) = library("libtcmalloc_minimal.so.4") {
            assert_eq!(tc.family, Family::Tcmalloc);
            assert!(!tc.glibc);
            assert!(symbols(&tc, Kind::Free).contains(&"_ZdlPvm".to_string()));
            assert_eq!(tc.points.iter().filter(|p| p.kind == Kind::New).count(), 2, "new and nothrow new");
            assert_eq!(tc.points.iter().filter(|p| p.kind == Kind::NewAligned).count(), 2);
        }
        // No address is probed twice in any of them.
        for a in [library("libjemalloc.so.2"), library("libmimalloc.so.2"), library("libtcmalloc_minimal.so.4")]
            .into_iter()
            .flatten()
        {
            let mut offsets: Vec<u64> = a.points.iter().filter(|p| p.path == a.object).map(|p| p.offset).collect();
            let n = offsets.len();
            offsets.sort();
            offsets.dedup();
            assert_eq!(offsets.len(), n, "{}", a.object.display());
        }
    }

    #[test]
    fn a_prefixed_jemalloc_is_found_without_a_flag() {
        let shim = Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("libxyz_je.so");
        let found = prefixed(std::slice::from_ref(&shim));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].family, Family::Jemalloc);
        assert_eq!(found[0].prefix, "xyz_je_");
        let names: Vec<&str> = found[0].points.iter().flat_map(|p| p.symbols.iter().map(String::as_str)).collect();
        for f in ["xyz_je_malloc", "xyz_je_free", "xyz_je_mallocx", "xyz_je_sdallocx"] {
            assert!(names.contains(&f), "{f} in {names:?}");
        }
        // glibc carries no prefixed jemalloc
        assert!(prefixed(&[Path::new(LIBS).join("libc.so.6")]).is_empty());
    }

    #[test]
    fn jemalloc_prefixes_need_the_whole_symbol_set() {
        let f = Function { offset: 0, size: 0 };
        let names = |list: &[&str]| -> HashMap<String, Function> { list.iter().map(|n| (n.to_string(), f)).collect() };
        let full = names(&["_rjem_mallocx", "_rjem_sdallocx", "_rjem_mallctl", "_rjem_malloc", "_rjem_free"]);
        assert_eq!(jemalloc_prefixes(&full), ["_rjem_"]);
        let partial = names(&["duckdb_je_mallocx", "duckdb_je_malloc", "duckdb_je_free"]);
        assert!(jemalloc_prefixes(&partial).is_empty(), "no sdallocx/mallctl: not a jemalloc");
        // the C names are the module's primary family, not a prefix
        assert!(jemalloc_prefixes(&names(&["mallocx", "sdallocx", "mallctl", "malloc", "free"])).is_empty());
    }

    #[test]
    fn an_unknown_prefix_is_a_clear_error() {
        let err = for_process(std::process::id(), "nosuchprefix_").unwrap_err().to_string();
        assert!(err.contains("nosuchprefix_malloc"), "{err}");
    }

    /// A script names the program that runs it: `#!` lines are followed (a pyenv shim, a
    /// shell wrapper), an ELF file or a missing one is itself.
    #[test]
    fn a_script_is_run_by_the_program_its_first_line_names() {
        let tmp = tempfile::Builder::new().prefix("memtrace-shebang-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let inner = dir.join("inner");
        fs::write(&inner, "#!/bin/sh -e\nexec true\n").unwrap();
        let outer = dir.join("outer");
        fs::write(&outer, format!("#! {}\n", inner.display())).unwrap();
        assert_eq!(program_behind(&outer), Path::new("/bin/sh"));
        assert_eq!(program_behind(Path::new("/bin/sh")), Path::new("/bin/sh"));
        assert_eq!(program_behind(&dir.join("missing")), dir.join("missing"));
        let looping = dir.join("loop");
        fs::write(&looping, format!("#!{}\n", looping.display())).unwrap();
        assert_eq!(program_behind(&looping), looping, "stops after 4");
        assert!(for_executable(&outer, "").is_ok(), "the shell's allocator");
    }
}
