//! Looking for allocators in the objects traced processes load (dlopen) and in the
//! programs they exec, on a thread of its own. Reading a big library's symbols held the
//! thread that drains the rings for 20–150 ms per library (libarrow: 150 ms on the 2-core
//! VM; importing pyarrow loads several such), and the rings of a program importing them
//! overflowed meanwhile; a new program's search (its executable and every library it
//! needs, in the dynamic linker's order: PostgreSQL's server, 40 of them) held it ~30 ms,
//! while the program's first mappings waited behind it and its stacks needed copies. The
//! answers are taken between drains, and the probes attached then.
use std::{
    path::{Path, PathBuf},
    sync::mpsc::{self, Receiver, Sender},
};

use crate::probes::allocator::{self, Allocator};

/// One object to look into.
struct Ask {
    what: What,
    /// The symbol prefix of `record --symbol-prefix`.
    prefix: String,
}

enum What {
    /// A mapped object. `skip_primary`: its own malloc family is known already: look for
    /// prefixed jemallocs only. `mapped`: the process that mapped it, and when.
    Object { object: PathBuf, skip_primary: bool, mapped: Option<(u32, u64)> },
    /// The program process `pid` exec'd (`exe` as the process names it, `canonical` the
    /// session's key for it), with what it preloads.
    Program { pid: u32, exe: PathBuf, canonical: PathBuf, preload: Vec<PathBuf> },
}

/// What a look found.
pub(super) enum Found {
    /// In a mapped object: for every followed process (with the process that mapped it
    /// and when, where a mapping record named it).
    Object(Vec<Allocator>, Option<(u32, u64)>),
    /// In an exec'd program: for process `pid`, and any later process of that program
    /// (`canonical`, `preload`). None when the program could not be read (the process
    /// exited, its file was replaced): not an answer to remember. `sure`: the process was
    /// there when its libraries were looked for, so its root was known (a chroot's program
    /// looked into after it exited had its libraries looked for in ours: an answer for it
    /// alone, not for its program's later processes).
    Program { pid: u32, canonical: PathBuf, preload: Vec<PathBuf>, allocators: Option<Vec<Allocator>>, sure: bool },
}

pub(super) struct ObjectChecks {
    asks: Option<Sender<Ask>>,
    answers: Receiver<Found>,
    /// Asked for and not answered yet.
    pending: usize,
}

impl ObjectChecks {
    pub(super) fn new() -> Self {
        let (asks, todo) = mpsc::channel::<Ask>();
        let (found, answers) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("memtrace-objects".into()).spawn(move || {
            while let Ok(ask) = todo.recv() {
                if found.send(look_into(&ask)).is_err() {
                    return;
                }
            }
        });
        if let Err(e) = &spawned {
            log::debug!("looking for allocators on the draining thread: {e}");
        }
        Self { asks: spawned.is_ok().then_some(asks), answers, pending: 0 }
    }

    /// Looks into `object` for allocators; the answer comes from [`Self::found`] (at
    /// once, when the thread could not be started).
    pub(super) fn ask(
        &mut self,
        object: PathBuf,
        prefix: &str,
        skip_primary: bool,
        mapped: Option<(u32, u64)>,
    ) -> Option<Found> {
        self.send(Ask { what: What::Object { object, skip_primary, mapped }, prefix: prefix.to_string() })
    }

    /// Looks for the allocators the program `exe` (known to the session as `canonical`)
    /// that process `pid` exec'd uses with `preload`: its executable and the libraries it
    /// needs, in the dynamic linker's order. The answer comes from [`Self::found`] (at
    /// once, when the thread could not be started).
    pub(super) fn ask_program(
        &mut self,
        pid: u32,
        (exe, canonical): (PathBuf, PathBuf),
        preload: Vec<PathBuf>,
        prefix: &str,
    ) -> Option<Found> {
        self.send(Ask { what: What::Program { pid, exe, canonical, preload }, prefix: prefix.to_string() })
    }

    fn send(&mut self, ask: Ask) -> Option<Found> {
        match &self.asks {
            Some(asks) => match asks.send(ask) {
                Ok(()) => {
                    self.pending += 1;
                    None
                }
                Err(mpsc::SendError(ask)) => Some(look_into(&ask)),
            },
            None => Some(look_into(&ask)),
        }
    }

    /// The answers still to come, waiting at most `timeout` for them all.
    pub(super) fn wait_for_the_rest(&mut self, timeout: std::time::Duration) -> Vec<Found> {
        let deadline = std::time::Instant::now() + timeout;
        let mut found = Vec::new();
        while self.pending > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.answers.recv_timeout(left) {
                Ok(answer) => {
                    self.pending -= 1;
                    found.push(answer);
                }
                Err(_) => break,
            }
        }
        found
    }

    /// What the looks answered since the last call found.
    pub(super) fn found(&mut self) -> Vec<Found> {
        if self.pending == 0 {
            return Vec::new();
        }
        let found: Vec<Found> = self.answers.try_iter().collect();
        self.pending -= found.len();
        found
    }
}

/// An object's allocators (its own malloc family unless known already, then prefixed
/// jemallocs), or a program's.
fn look_into(ask: &Ask) -> Found {
    let began = std::time::Instant::now();
    let found = look_into_now(ask);
    let what = match &ask.what {
        What::Object { object, .. } => object,
        What::Program { exe, .. } => exe,
    };
    log::debug!("allocators of {} looked for in {} ms", what.display(), began.elapsed().as_millis());
    found
}

fn look_into_now(ask: &Ask) -> Found {
    match &ask.what {
        What::Object { object, skip_primary, mapped } => {
            let objects = std::slice::from_ref(object);
            let mut found = allocator::prefixed(objects);
            if !skip_primary
                && let Ok(primary) = allocator::resolve(objects, &ask.prefix)
                && primary.file_id == allocator::file_id(object)
            {
                found.insert(0, primary);
            }
            Found::Object(found, *mapped)
        }
        What::Program { pid, exe, canonical, preload } => {
            // In a chroot or a container, the libraries are those of its file system.
            let root = crate::procfs::foreign_root(*pid);
            let allocators = match &root {
                Some(root) => allocator::all_for_executable_in(exe, root, Some(preload), &ask.prefix).ok(),
                None => allocator::all_for_executable(exe, Some(preload), &ask.prefix).ok(),
            };
            let sure = root.is_some() || Path::new("/proc").join(pid.to_string()).exists();
            Found::Program { pid: *pid, canonical: canonical.clone(), preload: preload.clone(), allocators, sure }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_without_allocators_answers_empty_and_a_missing_one_too() {
        let mut checks = ObjectChecks::new();
        for object in ["/nonexistent/libnothing.so", "/proc/self/status"] {
            if let Some(Found::Object(now, _)) = checks.ask(PathBuf::from(object), "", false, None) {
                assert!(now.is_empty());
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while checks.pending > 0 && std::time::Instant::now() < deadline {
            for found in checks.found() {
                assert!(matches!(found, Found::Object(ref a, _) if a.is_empty()));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(checks.pending, 0, "both answered");
    }

    /// The answer of the one look asked for: `now` when it came at once, else the
    /// thread's (waiting up to 10 s).
    fn first_answer(checks: &mut ObjectChecks, now: Option<Found>) -> Option<Found> {
        let mut found: Vec<Found> = now.into_iter().collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while found.is_empty() && std::time::Instant::now() < deadline {
            found = checks.found();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        found.pop()
    }

    #[test]
    fn the_c_library_is_found_on_the_thread() {
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists());
        let Some(libc) = libc else { return };
        let mut checks = ObjectChecks::new();
        let now = checks.ask(libc.clone(), "", false, None);
        let Some(Found::Object(found, _)) = first_answer(&mut checks, now) else { panic!("no answer for {libc:?}") };
        assert!(found.iter().any(|a| a.file_id == allocator::file_id(&libc)), "{libc:?}");
    }

    /// An answer for a process gone before it was looked into is for it alone: its root was
    /// not known (a chroot's program would have had its libraries looked for in ours).
    #[test]
    fn an_answer_for_a_process_gone_is_not_sure() {
        let exe = PathBuf::from("/bin/sh");
        let mut checks = ObjectChecks::new();
        for (pid, expected) in [(std::process::id(), true), (u32::MAX - 1, false)] {
            let now = checks.ask_program(pid, (exe.clone(), exe.clone()), Vec::new(), "");
            let Some(Found::Program { sure, allocators, .. }) = first_answer(&mut checks, now) else {
                panic!("no answer for pid {pid}")
            };
            assert_eq!(sure, expected, "pid {pid}");
            assert!(allocators.is_some(), "the program itself was read either way");
        }
    }

    #[test]
    fn a_program_that_cannot_be_read_is_answered_with_nothing_to_remember() {
        let exe = PathBuf::from("/nonexistent/program");
        let mut checks = ObjectChecks::new();
        let now = checks.ask_program(7, (exe.clone(), exe.clone()), Vec::new(), "");
        assert!(matches!(first_answer(&mut checks, now), Some(Found::Program { pid: 7, allocators: None, .. })));
    }

    #[test]
    fn a_program_is_answered_with_its_process_and_the_c_library() {
        let exe = PathBuf::from("/bin/sh");
        let mut checks = ObjectChecks::new();
        let canonical = std::fs::canonicalize(&exe).unwrap();
        let now = checks.ask_program(42, (exe.clone(), canonical.clone()), Vec::new(), "");
        let Some(Found::Program { pid, canonical: answered, preload, allocators, .. }) = first_answer(&mut checks, now)
        else {
            panic!("no answer for {exe:?}")
        };
        assert_eq!((pid, &answered, preload.len()), (42, &canonical, 0));
        let allocators = allocators.expect("/bin/sh is readable");
        assert!(
            allocators.iter().any(|a| a.family == crate::sizes::Family::Glibc),
            "{:?}",
            allocators.iter().map(|a| a.describe()).collect::<Vec<_>>()
        );
    }
}
