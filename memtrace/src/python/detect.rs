//! Finding the CPython interpreter of a process from outside it: the file that defines
//! `_PyRuntime` (the executable, as Debian and Ubuntu link it, or `libpython3.X.so`), its
//! version (`Py_Version`, or the file name on 3.10), where `_PyRuntime` loaded, and the code
//! of the evaluation loop (`_PyEval_EvalFrameDefault` and its cold part, which stripped
//! binaries leave unnamed: found as the unwind-table entry that the hot part jumps into).
//! A version or build memtrace cannot walk is named, never guessed.
use std::{
    fs::File,
    ops::Range,
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
};

use gimli::{BaseAddresses, CieOrFde, EhFrame, NativeEndian, UnwindSection as _};
use iced_x86::{Decoder, DecoderOptions, FlowControl};
use object::{Object as _, ObjectSection as _};

use super::layout::{DEBUG_OFFSETS_LEN, Layout};
use crate::{elf::ElfFile, procfs};
use memtrace_common::python::PyProcInfo;

/// glibc's `struct pthread`: `specific_1stblock` and `specific` (2.35 to 2.39 at least;
/// see docs/research/cpython-frames.md §2.2).
const PTHREAD_SPECIFIC_1ST: u16 = 0x310;
const PTHREAD_SPECIFIC: u16 = 0x510;

/// An interpreter the probes can walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// The file defining `_PyRuntime`, as seen from memtrace.
    pub path: PathBuf,
    /// "3.11.2".
    pub version: String,
    pub layout: Layout,
    /// What the probes need (addresses of this process).
    pub info: PyProcInfo,
    /// The evaluation loop's code, as file offsets of `path`: each native frame there is
    /// one C call of it, which ran a group of Python frames.
    pub eval: Vec<Range<u64>>,
}

/// What a process runs, Python-wise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Walkable(Interpreter),
    /// An interpreter whose frames memtrace does not walk, and why.
    Unsupported {
        path: PathBuf,
        version: String,
        why: String,
    },
}

impl Finding {
    pub fn describe(&self) -> String {
        match self {
            Finding::Walkable(i) => format!("Python {} ({})", i.version, i.path.display()),
            Finding::Unsupported { path, version, why } => {
                format!("Python {version} ({}): no Python frames: {why}", path.display())
            }
        }
    }
}

/// Reads `len` bytes of process `pid`'s memory at `addr`.
pub fn read_memory(pid: u32, addr: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let file = File::open(format!("/proc/{pid}/mem"))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, addr)?;
    Ok(buf)
}

/// What one interpreter file says, whichever process maps it.
#[derive(Debug, Clone)]
struct FileFacts {
    minor: u8,
    version: String,
    runtime_vaddr: u64,
    runtime_size: u64,
    eval: Vec<Range<u64>>,
}

/// Finds interpreters, reading each interpreter file once.
#[derive(Default)]
pub struct Detector {
    /// File → its facts (None: no `_PyRuntime`, or unreadable).
    files: std::collections::HashMap<PathBuf, Option<Result<FileFacts, Finding>>>,
}

impl Detector {
    /// The interpreter process `pid` runs, if any (None: no `_PyRuntime` in its files, or
    /// the process is gone).
    pub fn find(&mut self, pid: u32) -> Option<Finding> {
        find(pid, &mut self.files)
    }
}

fn facts(path: &Path) -> Option<Result<FileFacts, Finding>> {
    let elf = ElfFile::open(path).ok()?;
    let runtime = elf.symbol("_PyRuntime").ok()??;
    let unsupported = |version: &str, why: &str| Finding::Unsupported {
        path: path.to_path_buf(),
        version: version.to_string(),
        why: why.to_string(),
    };
    let Some((minor, version)) = version_of(&elf, path) else {
        return Some(Err(unsupported("of unknown version", "no Py_Version and no version in the file name")));
    };
    if Layout::for_minor(minor).is_none() {
        return Some(Err(unsupported(&version, "versions 3.10 to 3.13 are supported")));
    }
    let eval = eval_ranges(&elf);
    if eval.is_empty() {
        return Some(Err(unsupported(&version, "_PyEval_EvalFrameDefault not found")));
    }
    Some(Ok(FileFacts { minor, version, runtime_vaddr: runtime.vaddr, runtime_size: runtime.size, eval }))
}

fn find(
    pid: u32,
    files: &mut std::collections::HashMap<PathBuf, Option<Result<FileFacts, Finding>>>,
) -> Option<Finding> {
    let maps = procfs::Maps::read(pid).ok()?;
    let exe = procfs::exe(pid).ok();
    let mut candidates: Vec<PathBuf> = Vec::new();
    for m in maps.file_mappings().filter(|m| m.executable) {
        let name = m.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if (name.starts_with("python") || name.starts_with("libpython") || Some(&m.path) == exe.as_ref())
            && !candidates.contains(&m.path)
        {
            candidates.push(m.path.clone());
        }
    }
    let musl = maps.file_mappings().any(|m| m.path.to_string_lossy().contains("musl"));
    for mapped in candidates {
        let path = procfs::path_in_process(pid, &mapped);
        let facts = match files.entry(path.clone()).or_insert_with(|| facts(&path)) {
            None => continue,
            Some(Err(finding)) => return Some(finding.clone()),
            Some(Ok(f)) => f.clone(),
        };
        let version = facts.version.clone();
        let unsupported =
            |why: &str| Finding::Unsupported { path: path.clone(), version: version.clone(), why: why.to_string() };
        let layout = Layout::for_minor(facts.minor)?;
        if musl {
            return Some(unsupported("the thread state is found through glibc's pthread keys (musl libc)"));
        }
        // The lowest mapping of the file gives the load bias.
        let Some(first) = maps.file_mappings().filter(|m| m.path == mapped).min_by_key(|m| m.start) else { continue };
        let Some(vaddr) = ElfFile::open(&path).ok().and_then(|e| e.vaddr_of_offset(first.offset)) else { continue };
        let bias = first.start.wrapping_sub(vaddr);
        let runtime_addr = facts.runtime_vaddr.wrapping_add(bias);
        let layout = if facts.minor == 13 {
            match read_memory(pid, runtime_addr, DEBUG_OFFSETS_LEN).ok().and_then(|d| layout.from_debug_offsets(&d)) {
                Some(l) => l,
                None => return Some(unsupported("its _Py_DebugOffsets are not 3.13's (a free-threaded build?)")),
            }
        } else {
            layout
        };
        if facts.runtime_size != 0 && facts.runtime_size != layout.runtime_size {
            return Some(unsupported(&format!(
                "_PyRuntime is {} bytes, not {} (a debug build?)",
                facts.runtime_size, layout.runtime_size
            )));
        }
        let mut info = layout.probes;
        info.tss_key_addr = runtime_addr + layout.tss_key;
        info.pthread_specific_1st = PTHREAD_SPECIFIC_1ST;
        info.pthread_specific = PTHREAD_SPECIFIC;
        info.co_firstlineno = layout.code.firstlineno as u16;
        info.co_filename = layout.code.filename as u16;
        info.co_qualname = layout.code.qualname.unwrap_or(layout.code.name) as u16;
        info.co_linetable = layout.code.linetable as u16;
        info.str_ascii_data = layout.code.ascii_data as u16;
        return Some(Finding::Walkable(Interpreter { path, version, layout, info, eval: facts.eval }));
    }
    None
}

/// (minor, "3.X.Y") from `Py_Version` (3.11+), else from the file name (`python3.10`,
/// `libpython3.10.so.1.0`).
fn version_of(elf: &ElfFile, path: &Path) -> Option<(u8, String)> {
    if let Ok(Some(sym)) = elf.symbol("Py_Version")
        && let Some(offset) = sym.offset
        && let Ok(bytes) = <[u8; 4]>::try_from(elf.bytes(offset, 4))
    {
        let hex = u32::from_le_bytes(bytes);
        let (major, minor, micro) = ((hex >> 24) as u8, (hex >> 16) as u8, (hex >> 8) as u8);
        if major == 3 {
            return Some((minor, format!("{major}.{minor}.{micro}")));
        }
    }
    let name = path.file_name()?.to_string_lossy().into_owned();
    let rest = name.strip_prefix("lib").unwrap_or(&name).strip_prefix("python3.")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let minor: u8 = digits.parse().ok()?;
    Some((minor, format!("3.{minor}")))
}

/// The file offsets of the evaluation loop: `_PyEval_EvalFrameDefault`, and its cold part
/// (`.cold` when the symbol table names it; else the unwind-table entry that holds the
/// most targets of the jumps leaving the hot part).
fn eval_ranges(elf: &ElfFile) -> Vec<Range<u64>> {
    let Ok(functions) = elf.functions() else { return Vec::new() };
    let Some(hot) = functions.get("_PyEval_EvalFrameDefault").filter(|f| f.size > 0) else { return Vec::new() };
    let mut ranges = Vec::with_capacity(2);
    ranges.push(hot.offset..hot.offset + hot.size);
    if let Some(cold) = functions.get("_PyEval_EvalFrameDefault.cold").filter(|f| f.size > 0) {
        ranges.push(cold.offset..cold.offset + cold.size);
    } else if let Some(cold) = cold_part(elf, hot.offset, hot.size) {
        ranges.push(cold);
    }
    ranges
}

/// The cold part of a function split by the compiler: the targets of jumps from the hot
/// part to outside it, and the unwind-table entry (FDE) that covers most of them.
fn cold_part(elf: &ElfFile, offset: u64, size: u64) -> Option<Range<u64>> {
    let code = elf.bytes(offset, size as usize);
    let hot_vaddr = elf.vaddr_of_offset(offset)?;
    let mut decoder = Decoder::with_ip(64, code, hot_vaddr, DecoderOptions::NONE);
    let mut targets: Vec<u64> = Vec::new();
    let hot = hot_vaddr..hot_vaddr + size;
    for ins in &mut decoder {
        if matches!(ins.flow_control(), FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch) {
            let t = ins.near_branch_target();
            if t != 0 && !hot.contains(&t) {
                targets.push(t);
            }
        }
    }
    if targets.is_empty() {
        return None;
    }
    // The whole file, as `elf` has it mapped already.
    let file = object::File::parse(elf.bytes(0, usize::MAX)).ok()?;
    let section = file.section_by_name(".eh_frame")?;
    let eh = EhFrame::new(section.data().ok()?, NativeEndian);
    let bases = BaseAddresses::default().set_eh_frame(section.address());
    let mut best: Option<(usize, Range<u64>)> = None;
    let mut entries = eh.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else { continue };
        let range = fde.initial_address()..fde.end_address();
        if range.start <= hot.start && hot.start < range.end {
            continue;
        }
        let n = targets.iter().filter(|t| range.contains(t)).count();
        if n > 0 && best.as_ref().is_none_or(|(m, _)| n > *m) {
            best = Some((n, range));
        }
    }
    let (_, range) = best?;
    // The cold part is in the hot part's segment (before or after it).
    let start = offset.wrapping_add(range.start.wrapping_sub(hot_vaddr));
    Some(start..start + (range.end - range.start))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's python3 is stripped: the evaluation loop's cold part has no name, and is
    /// found from the jumps into it (13.9 KB at 0x430f05 in 3.11.2).
    #[test]
    fn the_cold_part_of_a_stripped_interpreter_is_found() {
        let path = std::fs::canonicalize("/usr/bin/python3").expect("python3 (cargo xtask setup installs it)");
        let elf = ElfFile::open(&path).unwrap();
        assert!(elf.symbol("_PyRuntime").unwrap().is_some());
        let ranges = eval_ranges(&elf);
        assert_eq!(ranges.len(), 2, "{ranges:x?}");
        let (hot, cold) = (&ranges[0], &ranges[1]);
        assert!(cold.end <= hot.start || cold.start >= hot.end, "{ranges:x?}");
        assert!((1024..1 << 20).contains(&(cold.end - cold.start)), "{ranges:x?}");
        let (minor, version) = version_of(&elf, &path).unwrap();
        assert!((10..=13).contains(&minor) && version.starts_with("3."), "{version}");
    }
}
