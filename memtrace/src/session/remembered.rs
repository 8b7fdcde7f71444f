//! The programs with an allocator of their own that a recorded command exec'd, kept beside
//! the unwind tables for the next `record` of the same command: their allocators are probed
//! before the command starts, so the first allocations of what it execs are seen. rustup's
//! `rustc` is a proxy that execs the toolchain's rustc, whose jemalloc is in its executable:
//! found only at the exec, it was probed 80–100 ms later, most of a short compile (1,495 of
//! rustc's ~30,000 allocations seen in one run).
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::mpsc::{Receiver, RecvTimeoutError},
    time::Duration,
};

use crate::{
    probes::allocator::{self, Allocator},
    unwind::cache::{DiskCache, FileKey},
};

/// Programs kept per command, newest first.
const MAX_PROGRAMS: usize = 32;

/// How long the session waits, once its probes are loaded, for the programs' symbols: a
/// look that takes longer (a slow disk) is given up, and the session starts without it.
const LOOK_DEADLINE: Duration = Duration::from_secs(2);

/// A look-up under way on its thread.
pub(super) struct Looking(Receiver<Vec<Allocator>>);

impl Looking {
    /// The allocators found, or none if the look takes past the deadline.
    pub(super) fn take(self) -> Vec<Allocator> {
        match self.0.recv_timeout(LOOK_DEADLINE) {
            Ok(found) => found,
            Err(RecvTimeoutError::Timeout) => {
                log::debug!(
                    "programs exec'd in earlier sessions: not looked into within {LOOK_DEADLINE:?}; not probed ahead"
                );
                Vec::new()
            }
            Err(RecvTimeoutError::Disconnected) => Vec::new(),
        }
    }
}

/// Looks up, on a thread of its own (it reads the programs' symbols while the probes
/// load), the allocators of the programs `command` exec'd in earlier sessions.
pub(super) fn look_up(command: PathBuf) -> Looking {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let _ = tx.send(look(&command));
    });
    Looking(rx)
}

fn look(command: &Path) -> Vec<Allocator> {
    let Some(cache) = DiskCache::open_default() else { return Vec::new() };
    let Ok(key) = FileKey::of(command) else { return Vec::new() };
    let programs: Vec<PathBuf> = cache.allocator_programs(&key).into_iter().filter(|p| p.exists()).collect();
    let mut found: Vec<Allocator> = Vec::new();
    for program in &programs {
        for a in allocator::all_for_executable(program, None, "").unwrap_or_default() {
            if !found.iter().any(|f| f.file_id == a.file_id && f.prefix == a.prefix) {
                found.push(a);
            }
        }
    }
    if !programs.is_empty() {
        log::debug!(
            "{}: probing ahead the allocators of {} programs it exec'd before: {:?}",
            command.display(),
            programs.len(),
            found.iter().map(|a| a.object.display().to_string()).collect::<Vec<_>>()
        );
    }
    found
}

/// Which of the programs exec'd in this session (`resolved`: canonical path, what it
/// preloaded, its allocators) brought an allocator of their own: one in none of the files
/// probed from the start without this memory (`base`). The command itself is not one.
pub(super) fn programs_with_own_allocators<'a>(
    command: &Path,
    base: &HashSet<(u64, u64)>,
    resolved: impl Iterator<Item = (&'a (PathBuf, Vec<PathBuf>), &'a Vec<Allocator>)>,
) -> Vec<PathBuf> {
    let mut programs: Vec<PathBuf> = resolved
        .filter(|((program, preload), allocators)| {
            // Not a program seen through a process's root (`/proc/PID/root/…`: a
            // container's), whose name means nothing to the next session.
            preload.is_empty()
                && program != command
                && !program.starts_with("/proc")
                && allocators.iter().any(|a| !base.contains(&a.file_id))
        })
        .map(|((program, _), _)| program.clone())
        .collect();
    // (A program may be answered twice: for a process gone before its look, and for one
    // alive.)
    programs.sort();
    programs.dedup();
    programs.truncate(MAX_PROGRAMS);
    programs
}

/// Keeps `programs` (found this session) for the next session of `command`; whether
/// they were kept.
pub(super) fn save(command: &Path, programs: &[PathBuf]) -> bool {
    if programs.is_empty() {
        return false;
    }
    let Some(cache) = DiskCache::open_default() else { return false };
    let Ok(key) = FileKey::of(command) else { return false };
    match cache.store_allocator_programs(&key, programs, MAX_PROGRAMS) {
        Ok(()) => true,
        Err(e) => {
            log::debug!("keeping the programs {} exec'd: {e}", command.display());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocator(object: &str, file_id: (u64, u64)) -> Allocator {
        Allocator {
            object: PathBuf::from(object),
            file_id,
            glibc: false,
            family: crate::sizes::Family::Unknown,
            prefix: String::new(),
            index: 0,
            mimalloc_pages: false,
            found: true,
            points: Vec::new(),
        }
    }

    #[test]
    fn a_program_counts_when_it_brings_an_allocator_not_probed_from_the_start() {
        let libc = allocator("/lib/libc.so.6", (1, 1));
        let jemalloc = allocator("/opt/rust/bin/rustc", (2, 2));
        let base: HashSet<(u64, u64)> = [(1, 1)].into();
        let resolved = [
            ((PathBuf::from("/usr/bin/cc"), Vec::new()), vec![libc.clone()]),
            ((PathBuf::from("/opt/rust/bin/rustc"), Vec::new()), vec![jemalloc.clone(), libc.clone()]),
            // What a program preloads is probed from the start already (installed libraries).
            ((PathBuf::from("/usr/bin/ls"), vec![PathBuf::from("/usr/lib/libjemalloc.so.2")]), vec![jemalloc.clone()]),
            ((PathBuf::from("/home/me/.cargo/bin/rustc"), Vec::new()), vec![jemalloc.clone()]),
            // Answered again for a process gone before its look: named once.
            ((PathBuf::from("/opt/rust/bin/rustc"), Vec::new()), vec![jemalloc]),
        ];
        let got = programs_with_own_allocators(
            Path::new("/home/me/.cargo/bin/rustc"),
            &base,
            resolved.iter().map(|(k, v)| (k, v)),
        );
        assert_eq!(got, [PathBuf::from("/opt/rust/bin/rustc")]);
    }
}
