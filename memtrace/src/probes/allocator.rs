//! Finding the allocator a process really calls, the way the dynamic linker would: the
//! executable, then LD_PRELOAD, then DT_NEEDED libraries breadth-first; the first object
//! defining `{prefix}malloc` and `{prefix}free` wins (a statically linked malloc is found in
//! the executable itself). `mmap`/`munmap` come from whichever object defines them (libc).
use std::{
    collections::{HashSet, VecDeque},
    env, fs,
    path::{Path, PathBuf},
};

use anyhow::{Result, bail};
use memtrace_common::Kind;

use crate::{
    elf::{ElfFile, Function},
    probes::placement,
    procfs,
};
use iced_x86::Register;

/// The argument registers the probes read for each kind of function.
fn argument_registers(kind: Kind) -> &'static [Register] {
    match kind {
        Kind::Malloc | Kind::Valloc | Kind::Pvalloc | Kind::Free => &[Register::RDI],
        Kind::Calloc | Kind::Realloc | Kind::Munmap => &[Register::RDI, Register::RSI],
        Kind::ReallocArray => &[Register::RDI, Register::RSI, Register::RDX],
        Kind::PosixMemalign => &[Register::RDI, Register::RDX],
        Kind::AlignedAlloc | Kind::Memalign | Kind::Mmap => &[Register::RSI],
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
    pub points: Vec<AttachPoint>,
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

const MAPPING: &[(&str, Kind)] = &[("mmap", Kind::Mmap), ("mmap64", Kind::Mmap), ("munmap", Kind::Munmap)];

/// Picks the allocator among `candidates` (in symbol-lookup order).
pub fn resolve(candidates: &[PathBuf], prefix: &str) -> Result<Allocator> {
    let family_names: Vec<String> = FAMILY.iter().map(|(n, _)| format!("{prefix}{n}")).collect();
    let mut wanted: Vec<&str> = family_names.iter().map(String::as_str).collect();
    wanted.push("__libc_malloc");
    let mut allocator = None;
    let mut mapping_points = None;
    for path in candidates {
        let Ok(elf) = ElfFile::open(path) else {
            continue;
        };
        if allocator.is_none() {
            let offsets = elf.function_offsets(&wanted)?;
            let malloc = format!("{prefix}malloc");
            let free = format!("{prefix}free");
            if offsets.contains_key(&malloc) && offsets.contains_key(&free) {
                let glibc = prefix.is_empty() && offsets.contains_key("__libc_malloc");
                let named: Vec<(String, Function, Kind)> = FAMILY
                    .iter()
                    .filter_map(|(n, k)| {
                        let name = format!("{prefix}{n}");
                        offsets.get(&name).map(|&o| (name, o, *k))
                    })
                    .collect();
                allocator = Some((path.clone(), glibc, group_by_offset(&elf, path, named)));
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
    let Some((object, glibc, mut points)) = allocator else {
        bail!(
            "no {prefix}malloc and {prefix}free found in {} (statically linked without symbols, or a custom allocator: try --symbol-prefix)",
            candidates.first().map(|p| p.display().to_string()).unwrap_or_default()
        );
    };
    points.extend(mapping_points.unwrap_or_default());
    Ok(Allocator { file_id: file_id(&object), object, glibc, points })
}

/// (device, inode) of a file, following symlinks (and /proc/PID/root).
pub fn file_id(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata(path).map(|m| (m.dev(), m.ino())).unwrap_or((0, 0))
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
    let mut dirs = Vec::new();
    read_ld_so_conf(Path::new("/etc/ld.so.conf"), &mut dirs, 0);
    for d in ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

fn read_ld_so_conf(path: &Path, dirs: &mut Vec<PathBuf>, depth: usize) {
    let Ok(text) = fs::read_to_string(path) else {
        return;
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include") {
            let pattern = Path::new(pattern.trim());
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
                    read_ld_so_conf(&file, dirs, depth + 1);
                }
            }
        } else if line.starts_with('/') {
            dirs.push(PathBuf::from(line));
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

/// The files a program at `exe` maps when exec'd with our environment: itself, its
/// interpreter, what it preloads and every library it needs, in lookup order.
pub fn program_files(exe: &Path) -> Vec<PathBuf> {
    let preload: Vec<PathBuf> = env::var("LD_PRELOAD")
        .unwrap_or_default()
        .split([':', ' '])
        .filter(|s| !s.is_empty())
        .filter_map(|s| search_dirs(s, &[]))
        .collect();
    let mut files = lookup_order(exe, &preload, &search_dirs);
    if let Some(interp) = ElfFile::open(exe).ok().and_then(|e| e.interpreter()) {
        files.push(PathBuf::from(interp));
    }
    files
}

/// The allocator a program at `exe` will use once exec'd with our environment.
pub fn for_executable(exe: &Path, prefix: &str) -> Result<Allocator> {
    let preload: Vec<PathBuf> = env::var("LD_PRELOAD")
        .unwrap_or_default()
        .split([':', ' '])
        .filter(|s| !s.is_empty())
        .filter_map(|s| search_dirs(s, &[]))
        .collect();
    resolve(&lookup_order(exe, &preload, &search_dirs), prefix)
}

/// The allocator a running process uses, from what it has mapped.
pub fn for_process(pid: u32, prefix: &str) -> Result<Allocator> {
    let maps = procfs::Maps::read(pid)?;
    let mapped: Vec<PathBuf> = {
        let mut seen = HashSet::new();
        maps.file_mappings()
            .filter(|m| m.executable)
            .map(|m| procfs::path_in_process(pid, &m.path))
            .filter(|p| seen.insert(p.clone()))
            .collect()
    };
    let exe = procfs::path_in_process(pid, &procfs::exe(pid)?);
    let preload: Vec<PathBuf> = procfs::ld_preload(pid)
        .iter()
        .filter_map(|p| mapped.iter().find(|m| m.file_name() == p.file_name()).cloned())
        .collect();
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
    resolve(&order, prefix).or_else(|e| for_executable(&exe, prefix).map_err(|_| e))
}

/// The C library the machine's programs use (for `record -a`): the one this process runs on.
pub fn system_libc(prefix: &str) -> Result<Allocator> {
    for_process(std::process::id(), prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_process_uses_glibc_malloc_with_aliases_merged() {
        let alloc = for_process(std::process::id(), "").unwrap();
        assert!(alloc.glibc);
        assert!(alloc.object.to_string_lossy().contains("libc.so"));
        let kinds: Vec<Kind> = alloc.points.iter().map(|p| p.kind).collect();
        for kind in [Kind::Malloc, Kind::Calloc, Kind::Realloc, Kind::Free, Kind::Mmap, Kind::Munmap] {
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

    #[test]
    fn an_unknown_prefix_is_a_clear_error() {
        let err = for_process(std::process::id(), "nosuchprefix_").unwrap_err().to_string();
        assert!(err.contains("nosuchprefix_malloc"), "{err}");
    }
}
