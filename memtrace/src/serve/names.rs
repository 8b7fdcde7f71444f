//! Naming what the model interned, off the tracer's thread: the namer takes the stacks,
//! modules and kernel call sites the model collected, looks up each new address once
//! (blazesym, while holding no lock the tracer or the endpoints wait on), and keeps the
//! [`StackTable`] the endpoints turn sites into frames and one-line labels with.
//!
//! A pass runs every second on the namer thread (so short-lived processes' files are read
//! while they are still there) and before each scrape (so a scrape never shows an address
//! a moment before its name). Bounded: evicted stacks leave the table, and the symbols are
//! forgotten all at once beyond [`MAX_SYMBOLS`] (then looked up again as needed).
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Condvar, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use memtrace_common::Kind;

use super::model::{Model, Pending, StackRef};
use crate::{
    analysis::Domain,
    grouping::first_frame,
    recording::{FileFrame, Symbol, SymbolKey},
    stacks::{Frame, StackTable},
    symbolize::Symbolizer,
};

/// Symbols (found or not) kept at most.
pub const MAX_SYMBOLS: usize = 1 << 21;

/// Locks a mutex, carrying on after a panic elsewhere (the data stays consistent enough to
/// report: every update is a few field writes).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The named stacks.
#[derive(Default)]
pub struct Names {
    table: StackTable,
    /// Addresses looked up, named or not.
    tried: HashSet<SymbolKey>,
    /// Per module: whether its file may be read for its offsets (it has the recorded build
    /// id).
    usable: HashMap<u32, bool>,
    /// Keys to look up in the next pass.
    wanted: HashSet<SymbolKey>,
    /// The symbols were forgotten: every stack's addresses are wanted again.
    rescan: bool,
}

/// What a pass looks up, outside any lock.
struct Work {
    objects: Vec<(u32, PathBuf, Vec<u64>)>,
    kernel: Vec<u64>,
}

impl Names {
    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub fn set_alloc_fns(&mut self, fns: crate::wrappers::AllocFns) {
        self.table.set_alloc_fns(fns);
    }

    /// Takes in what the model collected.
    pub(super) fn integrate(&mut self, pending: Pending) {
        for id in pending.evicted {
            self.table.remove_stack(id);
        }
        for m in pending.modules {
            self.usable.remove(&m.id);
            self.table.modules.insert(m.id, m);
        }
        for s in &pending.stacks {
            for &addr in &s.kernel {
                self.want(SymbolKey::Kernel(addr));
            }
            for &frame in &s.user {
                if matches!(frame, FileFrame::Module { .. }) {
                    self.want(SymbolKey::User(frame));
                }
            }
        }
        for addr in pending.call_sites {
            self.want(SymbolKey::Kernel(addr));
        }
        for s in pending.stacks {
            self.table.insert_stack(s);
        }
    }

    fn want(&mut self, key: SymbolKey) {
        if !self.tried.contains(&key) {
            self.wanted.insert(key);
        }
    }

    fn usable(&mut self, module: u32) -> Option<PathBuf> {
        let m = self.table.modules.get(&module)?;
        let path = PathBuf::from(&m.path);
        let ok = *self.usable.entry(module).or_insert_with(|| {
            !m.path.is_empty()
                && crate::python::function_of(m).is_none()
                && (m.build_id.is_empty() || crate::elf::build_id(&path).as_deref() == Some(&m.build_id[..]))
        });
        ok.then_some(path)
    }

    fn work(&mut self) -> Work {
        if self.rescan {
            self.rescan = false;
            let keys: Vec<SymbolKey> = self.table.symbol_keys().collect();
            for key in keys {
                self.want(key);
            }
        }
        let mut by_module: HashMap<u32, Vec<u64>> = HashMap::new();
        let mut kernel = Vec::new();
        for key in std::mem::take(&mut self.wanted) {
            self.tried.insert(key);
            match key {
                SymbolKey::Kernel(addr) => kernel.push(addr),
                SymbolKey::User(FileFrame::Module { module, offset }) => {
                    by_module.entry(module).or_default().push(offset)
                }
                SymbolKey::User(FileFrame::Address(_)) => {}
            }
        }
        let objects = by_module
            .into_iter()
            .filter_map(|(module, mut offsets)| {
                offsets.sort_unstable();
                Some((module, self.usable(module)?, offsets))
            })
            .collect();
        kernel.sort_unstable();
        Work { objects, kernel }
    }

    pub(super) fn insert(&mut self, found: Vec<(SymbolKey, Vec<Symbol>)>) {
        if self.table.symbols.len() + self.tried.len() > MAX_SYMBOLS {
            self.table.clear_symbols();
            self.tried.clear();
            self.rescan = true;
        }
        self.table.extend_symbols(found);
        self.refresh();
    }

    /// Rebuilds the table so the frames it cached are named again.
    fn refresh(&mut self) {
        self.table.clear_names();
    }

    /// The frames of a site, innermost first (see [`StackTable::frames`]).
    pub fn frames(&mut self, stack: StackRef, call_site: u64) -> Vec<Frame> {
        self.table.frames(u64::from(stack.0), call_site)
    }

    /// Stacks known, for the self metrics.
    pub fn stacks(&self) -> usize {
        self.table.stack_count()
    }

    pub fn symbols(&self) -> usize {
        self.table.symbols.len()
    }
}

impl Work {
    fn is_empty(&self) -> bool {
        self.objects.is_empty() && self.kernel.is_empty()
    }

    fn run(self, symbolizer: &Symbolizer) -> Vec<(SymbolKey, Vec<Symbol>)> {
        let mut found = Vec::new();
        for (module, path, offsets) in self.objects {
            // Return addresses point after the call: name the call instruction.
            let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
            for (offset, syms) in offsets.iter().zip(symbolizer.object(&path, &lookups)) {
                if !syms.is_empty() {
                    found.push((SymbolKey::User(FileFrame::Module { module, offset: *offset }), syms));
                }
            }
        }
        let lookups: Vec<u64> = self.kernel.iter().map(|a| a.saturating_sub(1)).collect();
        for (addr, syms) in self.kernel.iter().zip(symbolizer.kernel(&lookups)) {
            if !syms.is_empty() {
                found.push((SymbolKey::Kernel(*addr), syms));
            }
        }
        found
    }
}

/// How long one symbolizer (and the files it parsed and cached) is kept at most, and how
/// long it is kept once no pass needs it.
const SYMBOLIZER_LIFETIME: Duration = Duration::from_secs(600);
const SYMBOLIZER_IDLE: Duration = Duration::from_secs(60);
/// How often the namer thread looks for new stacks on its own.
const NAMING_INTERVAL: Duration = Duration::from_secs(1);
/// How long a scrape waits for the namer before it goes on with the names there are.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// Passes asked of the namer thread, and done.
#[derive(Default)]
struct Progress {
    running: bool,
    stop: bool,
    asked: u64,
    done: u64,
}

/// The names and the passes that fill them. The symbolizer (blazesym's, which keeps what
/// it parsed: a module, the kernel's symbols) lives on the namer thread, replaced now and
/// then so its caches stay bounded; scrapes ask that thread for a pass and wait for it.
#[derive(Default)]
pub struct Namer {
    names: Mutex<Names>,
    /// One pass at a time.
    pass: Mutex<()>,
    progress: Mutex<Progress>,
    wake: Condvar,
}

impl Namer {
    /// Names what the model collected since the last pass. `symbolizer` is the one kept
    /// between passes (with when it was last used): made when needed, dropped once idle
    /// or old (what it parsed goes with it).
    fn pass(&self, model: &Mutex<Model>, symbolizer: &mut Option<(Symbolizer, Instant, Instant)>) {
        let _one_at_a_time = lock(&self.pass);
        if symbolizer
            .as_ref()
            .is_some_and(|(_, born, used)| born.elapsed() >= SYMBOLIZER_LIFETIME || used.elapsed() >= SYMBOLIZER_IDLE)
        {
            *symbolizer = None;
        }
        let pending = {
            let mut m = lock(model);
            m.has_pending().then(|| m.take_pending())
        };
        let work = {
            let mut n = lock(&self.names);
            match pending {
                Some(p) => n.integrate(p),
                None if !n.rescan => return,
                None => {}
            }
            n.work()
        };
        let found = if work.is_empty() {
            Vec::new()
        } else {
            let (s, _, used) = symbolizer.get_or_insert_with(|| (Symbolizer::new(), Instant::now(), Instant::now()));
            *used = Instant::now();
            work.run(s)
        };
        lock(&self.names).insert(found);
    }

    /// The namer thread: a pass every second, and whenever a scrape asks, until stopped.
    pub fn run(&self, model: &Mutex<Model>) {
        let mut symbolizer = None;
        lock(&self.progress).running = true;
        loop {
            let asked = {
                let progress = lock(&self.progress);
                let (progress, _) = self
                    .wake
                    .wait_timeout_while(progress, NAMING_INTERVAL, |p| !p.stop && p.asked == p.done)
                    .unwrap_or_else(|e| e.into_inner());
                if progress.stop {
                    break;
                }
                progress.asked
            };
            self.pass(model, &mut symbolizer);
            lock(&self.progress).done = asked;
            self.wake.notify_all();
        }
        let mut progress = lock(&self.progress);
        progress.running = false;
        progress.done = progress.asked;
        self.wake.notify_all();
    }

    /// Stops the namer thread.
    pub fn stop(&self) {
        lock(&self.progress).stop = true;
        self.wake.notify_all();
    }

    /// Names everything collected so far before a scrape: by the namer thread, or here
    /// when none runs.
    pub fn sync(&self, model: &Mutex<Model>) {
        let mut progress = lock(&self.progress);
        if !progress.running {
            drop(progress);
            self.pass(model, &mut None);
            return;
        }
        progress.asked += 1;
        let want = progress.asked;
        self.wake.notify_all();
        let _ = self
            .wake
            .wait_timeout_while(progress, SYNC_TIMEOUT, |p| p.running && p.done < want)
            .unwrap_or_else(|e| e.into_inner());
    }

    pub fn names(&self) -> MutexGuard<'_, Names> {
        lock(&self.names)
    }
}

/// A frame on one line: `function (file:line)`, the file without its directory.
pub fn frame_label(f: &Frame) -> String {
    match (&f.file, f.line) {
        (Some(file), Some(line)) => {
            let short =
                Path::new(&**file).file_name().map_or_else(|| file.to_string(), |n| n.to_string_lossy().into_owned());
            format!("{} ({short}:{line})", f.function)
        }
        _ => f.function.to_string(),
    }
}

/// A site's name: its first frame in its domain (the allocating function for user
/// allocations, past the allocation wrappers; the requesting function for kernel ones), or
/// what stands for it.
pub fn site_label(domain: Domain, kind: Kind, stack: StackRef, frames: &[Frame]) -> String {
    match first_frame(domain, frames) {
        Some(f) => frame_label(f),
        None if stack == StackRef::OVERFLOW => "[stack table full]".into(),
        None => format!("[no stack: {}]", kind.name()),
    }
}
