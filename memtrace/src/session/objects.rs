//! Looking for allocators in the objects traced processes load (dlopen), on a thread of
//! its own. Reading a big library's symbols held the thread that drains the rings for
//! 20–150 ms per library (libarrow: 150 ms on the 2-core VM; importing pyarrow loads
//! several such), and the rings of a program importing them overflowed meanwhile. The
//! answers are taken between drains, and the probes attached then.
use std::{
    path::PathBuf,
    sync::mpsc::{self, Receiver, Sender},
};

use crate::probes::allocator::{self, Allocator};

/// One object to look into.
struct Ask {
    object: PathBuf,
    /// The symbol prefix of `record --symbol-prefix`.
    prefix: String,
    /// Its own malloc family is known already: look for prefixed jemallocs only.
    skip_primary: bool,
}

pub(super) struct ObjectChecks {
    asks: Option<Sender<Ask>>,
    answers: Receiver<Vec<Allocator>>,
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
    pub(super) fn ask(&mut self, object: PathBuf, prefix: &str, skip_primary: bool) -> Option<Vec<Allocator>> {
        let ask = Ask { object, prefix: prefix.to_string(), skip_primary };
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

    /// The allocators found since the last call.
    pub(super) fn found(&mut self) -> Vec<Allocator> {
        if self.pending == 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for found in self.answers.try_iter() {
            self.pending -= 1;
            out.extend(found);
        }
        out
    }
}

/// The allocators of one object: its own malloc family (unless known already), then
/// prefixed jemallocs.
fn look_into(ask: &Ask) -> Vec<Allocator> {
    let objects = std::slice::from_ref(&ask.object);
    let mut found = allocator::prefixed(objects);
    if !ask.skip_primary
        && let Ok(primary) = allocator::resolve(objects, &ask.prefix)
        && primary.file_id == allocator::file_id(&ask.object)
    {
        found.insert(0, primary);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_without_allocators_answers_empty_and_a_missing_one_too() {
        let mut checks = ObjectChecks::new();
        for object in ["/nonexistent/libnothing.so", "/proc/self/status"] {
            if let Some(now) = checks.ask(PathBuf::from(object), "", false) {
                assert!(now.is_empty());
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while checks.pending > 0 && std::time::Instant::now() < deadline {
            assert!(checks.found().is_empty());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(checks.pending, 0, "both answered");
    }

    #[test]
    fn the_c_library_is_found_on_the_thread() {
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists());
        let Some(libc) = libc else { return };
        let mut checks = ObjectChecks::new();
        let mut found = checks.ask(libc.clone(), "", false).unwrap_or_default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while found.is_empty() && std::time::Instant::now() < deadline {
            found = checks.found();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(found.iter().any(|a| a.file_id == allocator::file_id(&libc)), "{libc:?}");
    }
}
