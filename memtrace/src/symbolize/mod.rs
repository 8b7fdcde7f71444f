//! Turning addresses into names with blazesym: one long-lived symbolizer, called once per
//! object with every distinct offset of that object in one batch. Results are inline
//! chains, innermost function first, each with its own source location. [`Background`]
//! keeps the symbolizer on a thread of its own, so that its caches (the kernel's symbols,
//! each object's tables) fill while a recording runs rather than after it; at the end a
//! second one on the waiting thread shares the objects left with it.
use std::{
    borrow::Cow,
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    thread::JoinHandle,
    time::Instant,
};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer as Blaze, cache, evict,
    source::{Elf, Kernel, Source},
};

use crate::recording::Symbol;

mod pages;

pub struct Symbolizer {
    blaze: Blaze,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

fn chain(sym: &blazesym::symbolize::Sym<'_>) -> Vec<Symbol> {
    let location = |ci: Option<&blazesym::symbolize::CodeInfo<'_>>| -> (Option<String>, u32) {
        match ci {
            Some(ci) => {
                let file = match &ci.dir {
                    Some(dir) if !dir.as_os_str().is_empty() => dir.join(&ci.file).to_string_lossy().into_owned(),
                    _ => ci.file.to_string_lossy().into_owned(),
                };
                (Some(file), ci.line.unwrap_or(0))
            }
            None => (None, 0),
        }
    };
    let mut out = Vec::with_capacity(sym.inlined.len() + 1);
    for inlined in sym.inlined.iter().rev() {
        let (file, line) = location(inlined.code_info.as_ref());
        out.push(Symbol { name: demangle(&inlined.name).into(), file: file.map(Into::into), line, inlined: true });
    }
    let (file, line) = location(sym.code_info.as_deref());
    out.push(Symbol { name: demangle(&sym.name).into(), file: file.map(Into::into), line, inlined: false });
    merge_self_inlined(out)
}

/// One function described as inlined into itself at one address, which GCC's partial
/// inlining and clones (`.part.0`) leave in the debug information (`_PyBytes_FromSize`
/// within `_PyBytes_FromSize`, `Py_InitializeFromConfig` within itself), is one frame: at
/// the innermost one's line (where the code is; the outer one's is the clone's call, or
/// the function's first line), inlined as the outer one is. A stack read the name twice.
/// (A function GCC inlines into itself for recursion, at `-O3`, loses those levels: rare,
/// where the clones are in every GCC-built library.)
fn merge_self_inlined(mut chain: Vec<Symbol>) -> Vec<Symbol> {
    chain.dedup_by(|outer, inner| {
        let same = outer.name == inner.name;
        if same {
            inner.inlined = outer.inlined;
        }
        same
    });
    chain
}

/// A function's name as people read it: mangled Rust and C++ names (`_R…`, `_ZN…17h…E`,
/// `_Z…`) demangled, any other name as it is. blazesym's own demangling (off here) also ran
/// names of no known language through the C++ demangler, which reads a lone type code as a
/// type: C functions named `a`, `b`, `i` or `v` came out as `signed char`, `bool`, `int`
/// and `void`.
pub fn demangle(name: &str) -> Cow<'_, str> {
    if (name.starts_with("_R") || name.starts_with("_ZN"))
        && let Ok(d) = rustc_demangle::try_demangle(name)
    {
        return Cow::Owned(format!("{d:#}"));
    }
    if name.starts_with("_Z")
        && let Ok(sym) = cpp_demangle::Symbol::new(name)
        && let Ok(d) = sym.demangle()
    {
        return Cow::Owned(d);
    }
    Cow::Borrowed(name)
}

/// Names the offsets no symbol names (`out`'s empty chains) after the function that holds
/// them, where the file's call-frame information tells where that function starts:
/// `libsqlite3.so.0.8.6+0x96b40`, as [`anonymous_name`] writes it. Two call sites in one
/// function of a stripped library are then one function (`report --by function`, the
/// towers of a flame graph), as they are where a symbol names it.
fn name_anonymous(path: &Path, offsets: &[u64], out: &mut [Vec<Symbol>]) {
    if out.iter().all(|chain| !chain.is_empty()) {
        return;
    }
    let started = Instant::now();
    let Ok(cfi) = crate::unwind::cfi::Cfi::open(path) else { return };
    let functions = cfi.functions();
    log::debug!(
        "{}: {} functions read from its call-frame information in {} ms",
        path.display(),
        functions.len(),
        started.elapsed().as_millis()
    );
    let module = crate::stacks::module_name(&path.to_string_lossy());
    for (chain, &offset) in out.iter_mut().zip(offsets) {
        if chain.is_empty()
            && let Some(start) = cfi.function_start(&functions, offset)
        {
            chain.push(Symbol { name: anonymous_name(&module, start).into(), file: None, line: 0, inlined: false });
        }
    }
}

/// The name of a function no symbol names: its module's and where it starts there.
pub fn anonymous_name(module: &str, start: u64) -> String {
    format!("{module}+0x{start:x}")
}

/// Whether `name`, a symbol of a frame of `module`, is one [`anonymous_name`] gave.
pub fn is_anonymous(module: &str, name: &str) -> bool {
    name.strip_prefix(module)
        .and_then(|rest| rest.strip_prefix("+0x"))
        .is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Symbolizer {
    pub fn new() -> Self {
        Self {
            blaze: Blaze::builder().enable_code_info(true).enable_inlined_fns(true).enable_demangling(false).build(),
        }
    }

    fn run(&self, src: &Source<'_>, input: Input<&[u64]>, n: usize) -> Vec<Vec<Symbol>> {
        match self.blaze.symbolize(src, input) {
            Ok(results) => results
                .iter()
                .map(|r| match r {
                    Symbolized::Sym(sym) => chain(sym),
                    Symbolized::Unknown(_) => Vec::new(),
                })
                .collect(),
            Err(_) => vec![Vec::new(); n],
        }
    }

    /// Kernel text addresses (kallsyms, or a vmlinux with debug info when one is found).
    pub fn kernel(&self, addrs: &[u64]) -> Vec<Vec<Symbol>> {
        if addrs.is_empty() {
            return Vec::new();
        }
        let src = Source::Kernel(Kernel::default());
        self.run(&src, Input::AbsAddr(addrs), addrs.len())
    }

    /// File offsets inside the ELF object at `path` (DWARF and separate debug info used
    /// when present, else the symbol tables).
    pub fn object(&self, path: &Path, offsets: &[u64]) -> Vec<Vec<Symbol>> {
        if offsets.is_empty() {
            return Vec::new();
        }
        let src = Source::Elf(Elf::new(path));
        let mut out = self.run(&src, Input::FileOffset(offsets), offsets.len());
        name_anonymous(path, offsets, &mut out);
        out
    }

    /// As [`Symbolizer::object`], then forgets what was read of the object (its parsed
    /// debug information, its mapping): for a caller that asks once per object, so that
    /// memory holds one object's at a time, not every one's (a heavy program's libraries
    /// raised `record`'s peak by ~130 MB while it symbolized them).
    pub fn object_once(&mut self, path: &Path, offsets: &[u64]) -> Vec<Vec<Symbol>> {
        let out = self.object(path, offsets);
        self.forget(path);
        out
    }

    /// Forgets what was read of the object at `path` (its parsed debug information, its
    /// mapping).
    fn forget(&mut self, path: &Path) {
        let _ = self.blaze.evict(&evict::Evict::Elf(evict::Elf::new(path)));
    }

    /// As [`Symbolizer::object_once`], for a big object: the pages of its debug information
    /// are reclaimed while it is read, past a cap ([`pages::bounded`]).
    fn big_object_once(&mut self, path: &Path, offsets: &[u64]) -> Vec<Vec<Symbol>> {
        let (out, reclaimed) = pages::bounded(path, || self.object(path, offsets));
        self.forget(path);
        if reclaimed > 0 {
            log::debug!("{}: its debug information's pages reclaimed {reclaimed} times while read", path.display());
        }
        out
    }

    /// Reads the kernel's symbols now, so that a later [`Symbolizer::kernel`] finds them read.
    pub fn prepare_kernel(&self) {
        let _ = self.kernel(&[0]);
    }

    /// Reads the symbol tables of the object at `path` now. (Its separate debug information,
    /// when installed, is still indexed at the first lookup: doing that ahead costs more CPU
    /// than a short recording's start can spare.)
    pub fn prepare_object(&self, path: &Path) {
        let _ = self.blaze.cache(&cache::Cache::Elf(cache::Elf::new(path)));
    }
}

type Job = Box<dyn FnOnce(&mut Symbolizer) + Send>;

/// Files the background symbolizer takes at the end of a recording, at most in size: the
/// larger ones are read one at a time, on the calling thread.
const HELPER_MAX_FILE: u64 = 64 << 20;

/// The next object of a queue sorted largest file first (the last field is the file's
/// size): the calling thread's from the front, the helper's from the back while under
/// [`HELPER_MAX_FILE`].
fn take_next<T>(
    queue: &mut VecDeque<(usize, PathBuf, T, u64)>,
    largest_first: bool,
) -> Option<(usize, PathBuf, T, u64)> {
    match largest_first {
        true => queue.pop_front(),
        false if queue.back().is_some_and(|job| job.3 < HELPER_MAX_FILE) => queue.pop_back(),
        false => None,
    }
}

/// A [`Symbolizer`] on a thread of its own (it cannot move between threads), taking jobs
/// in order. Preparing (`prepare_*`) returns at once; [`Background::run`] waits for its
/// answer.
pub struct Background {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    pub fn start() -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("symbolizer".into())
            .spawn(move || {
                // Preparing is work ahead of need: it yields the CPU to the probes' loading
                // (the kernel verifying them on the other threads) and to event handling.
                // SAFETY: plain syscalls on this thread's own id.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
                let mut symbolizer = Symbolizer::new();
                for job in queue {
                    job(&mut symbolizer);
                }
            })
            .ok();
        Self { jobs: thread.as_ref().map(|_| jobs), thread }
    }

    fn send(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok())
    }

    /// Starts reading the kernel's symbols.
    pub fn prepare_kernel(&self) {
        self.send(Box::new(|s| s.prepare_kernel()));
    }

    /// Starts reading the symbol tables of the object at `path`.
    pub fn prepare_object(&self, path: PathBuf) {
        self.send(Box::new(move |s| s.prepare_object(&path)));
    }

    /// From now on the symbolizer runs at the priority of the other threads
    /// ([`crate::session::priority::own`]): at the end of
    /// a recording naming the frames is what the user waits for, and at the lowest
    /// priority it got little of two cores beside the end-of-run warnings' pass.
    /// (Raising a priority takes CAP_SYS_NICE: without it, as with CAP_BPF and
    /// CAP_PERFMON alone, the thread stays where it was, and says so in the debug log.)
    pub fn hurry(&self) {
        self.send(Box::new(|_| {
            // SAFETY: a plain syscall on the symbolizer thread's own id.
            let nice = crate::session::priority::own();
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) } != 0 {
                log::debug!("the symbolizer keeps its low priority: {}", std::io::Error::last_os_error());
            }
        }));
    }

    /// The symbols of each object's offsets (`object_once`), handed to `emit` with the
    /// object's index as each object is done, so that only one big object's names are held
    /// at a time (PyTorch's held ~100 MB of names when all were handed back at once): the
    /// calling thread takes the objects largest file first, the background symbolizer the
    /// smallest first, and only files under [`HELPER_MAX_FILE`]: two big objects are never
    /// read at once (PyTorch's libtriton, DWARF read in place, and libtorch_cpu side by side
    /// held ~150 MB of their pages and the peak of the recording). At the end of a recording
    /// the user waits for this: the heavy Python bench's ~100 objects took ~230 ms on one
    /// thread (libpython's debug information 80 ms, the C library's 50 ms). An object the
    /// background symbolizer took and never finished (it panicked) is not emitted.
    pub fn objects(&self, jobs: Vec<(PathBuf, Vec<u64>)>, emit: &mut dyn FnMut(usize, Vec<Vec<Symbol>>)) {
        let mut queue: Vec<(usize, PathBuf, Vec<u64>, u64)> = jobs
            .into_iter()
            .enumerate()
            .map(|(i, (path, offsets))| {
                let size = std::fs::metadata(&path).map_or(0, |m| m.len());
                (i, path, offsets, size)
            })
            .collect();
        queue.sort_by_key(|&(_, _, _, size)| std::cmp::Reverse(size));
        let queue = Arc::new(Mutex::new(VecDeque::from(queue)));
        // The background symbolizer's objects, done and not yet emitted.
        type Done = Mutex<Vec<(usize, Vec<Vec<Symbol>>)>>;
        let done: Arc<Done> = Arc::default();
        type Queue = Mutex<VecDeque<(usize, PathBuf, Vec<u64>, u64)>>;
        let next = |s: &mut Symbolizer, queue: &Queue, largest_first: bool| {
            let (i, path, offsets, size) = queue.lock().ok().and_then(|mut q| take_next(&mut q, largest_first))?;
            let started = Instant::now();
            // Only the calling thread takes big objects.
            let symbols = match size >= HELPER_MAX_FILE {
                true => s.big_object_once(&path, &offsets),
                false => s.object_once(&path, &offsets),
            };
            log::debug!(
                "{}: {} addresses symbolized in {} ms",
                path.display(),
                offsets.len(),
                started.elapsed().as_millis()
            );
            Some((i, symbols))
        };
        let emit_done = |emit: &mut dyn FnMut(usize, Vec<Vec<Symbol>>)| {
            let ready = done.lock().map(|mut d| std::mem::take(&mut *d)).unwrap_or_default();
            for (i, symbols) in ready {
                emit(i, symbols);
            }
        };
        let (finished_tx, finished) = mpsc::sync_channel(1);
        let (q, d) = (Arc::clone(&queue), Arc::clone(&done));
        let helped = self.send(Box::new(move |s| {
            while let Some(result) = next(s, &q, false) {
                if let Ok(mut d) = d.lock() {
                    d.push(result);
                }
            }
            let _ = finished_tx.send(());
        }));
        let mut symbolizer = Symbolizer::new();
        while let Some((i, symbols)) = next(&mut symbolizer, &queue, true) {
            emit(i, symbols);
            emit_done(emit);
        }
        drop(symbolizer);
        if helped {
            // Its last object; an error: it panicked, what it held stays unnamed.
            let _ = finished.recv();
        }
        emit_done(emit);
    }

    /// Runs `f` on the symbolizer after the jobs before it; None when the thread is gone
    /// (it could not start, or a job panicked).
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce(&mut Symbolizer) -> R + Send + 'static) -> Option<R> {
        let (answer, result) = mpsc::sync_channel(1);
        if !self.send(Box::new(move |s| {
            let _ = answer.send(f(s));
        })) {
            return None;
        }
        result.recv().ok()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_function_inlined_into_itself_is_one_frame_at_the_innermost_line() {
        let sym = |name: &str, line: u32, inlined: bool| Symbol { name: name.into(), file: None, line, inlined };
        let chain = vec![
            sym("_PyBytes_FromSize", 101, true),
            sym("_PyBytes_FromSize", 84, true),
            sym("bytes_new_impl", 2676, true),
            sym("bytes_new", 2600, false),
        ];
        let merged = merge_self_inlined(chain);
        let lines: Vec<(&str, u32, bool)> = merged.iter().map(|s| (&*s.name, s.line, s.inlined)).collect();
        assert_eq!(
            lines,
            [("_PyBytes_FromSize", 101, true), ("bytes_new_impl", 2676, true), ("bytes_new", 2600, false)]
        );
        let merged = merge_self_inlined(vec![sym("Py_Init", 1254, true), sym("Py_Init", 1239, false)]);
        assert_eq!(merged.iter().map(|s| (s.line, s.inlined)).collect::<Vec<_>>(), [(1254, false)]);
        // Recursion is frames at different addresses: another chain each, left alone.
        assert_eq!(merge_self_inlined(vec![sym("f", 3, false)]).len(), 1);
    }

    /// The helper takes the small files from the back and leaves every big one to the
    /// caller, so two big objects are never read at once.
    #[test]
    fn big_objects_are_left_to_the_calling_thread_one_at_a_time() {
        let mb = |n: u64| n << 20;
        let mut queue: VecDeque<(usize, PathBuf, (), u64)> = [mb(500), mb(450), mb(64), mb(63), mb(2), 0]
            .iter()
            .enumerate()
            .map(|(i, &s)| (i, PathBuf::new(), (), s))
            .collect();
        let sizes = |q: &mut VecDeque<_>, first: bool| {
            std::iter::from_fn(|| take_next(q, first).map(|j| j.3)).collect::<Vec<u64>>()
        };
        assert_eq!(sizes(&mut queue, false), vec![0, mb(2), mb(63)]);
        assert_eq!(sizes(&mut queue, true), vec![mb(500), mb(450), mb(64)]);
        assert!(queue.is_empty());
    }

    #[inline(never)]
    fn a_function_with_a_distinctive_name() -> usize {
        std::hint::black_box(a_function_with_a_distinctive_name as *const () as usize)
    }

    #[test]
    fn symbolizes_our_own_function_by_file_offset() {
        let addr = a_function_with_a_distinctive_name() as u64;
        let maps = crate::procfs::Maps::read_self().unwrap();
        let mapping = maps.find(addr).unwrap();
        let offset = mapping.file_offset(addr);
        let result = Symbolizer::new().object(&mapping.path, &[offset, 0]);
        assert_eq!(result.len(), 2);
        let outer = result[0].last().unwrap();
        assert!(outer.name.contains("a_function_with_a_distinctive_name"), "{result:?}");
        assert!(outer.file.as_deref().unwrap_or("").ends_with("symbolize/mod.rs"), "{result:?}");
        // Read with its debug information's pages bounded, the same names.
        assert_eq!(Symbolizer::new().big_object_once(&mapping.path, &[offset, 0]), result);
    }

    /// An address no symbol names is named after where its function's FDE starts: the
    /// function's first byte, for any address inside it.
    #[test]
    fn an_unnamed_address_is_named_after_where_its_function_starts() {
        let start = a_function_with_a_distinctive_name as *const () as u64;
        let maps = crate::procfs::Maps::read_self().unwrap();
        let mapping = maps.find(start).unwrap();
        let (first, inside) = (mapping.file_offset(start), mapping.file_offset(start + 3));
        let cfi = crate::unwind::cfi::Cfi::open(&mapping.path).unwrap();
        let functions = cfi.functions();
        assert!(functions.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(cfi.function_start(&functions, inside), Some(first));
        assert_eq!(cfi.function_start(&functions, first), Some(first));
        // Outside the file's segments: none. In padding between two functions (past the end
        // of one FDE, before the next): none.
        assert_eq!(cfi.function_start(&functions, u64::MAX / 2), None);
        let text = cfi.segments.iter().find(|s| s.executable).unwrap();
        let gap = functions
            .windows(2)
            .find(|w| w[0].1 < w[1].0 && (text.vaddr..text.vaddr + text.file_size).contains(&w[0].1))
            .map(|w| w[0].1)
            .expect("padding between two functions");
        assert_eq!(cfi.function_start(&functions, gap - text.vaddr + text.file_offset), None);
        assert!(cfi.function_start(&functions, gap - 1 - text.vaddr + text.file_offset).is_some());
        let mut out = vec![Vec::new(), vec![Symbol { name: "named".into(), ..Default::default() }]];
        name_anonymous(&mapping.path, &[inside, inside], &mut out);
        let module = crate::stacks::module_name(&mapping.path.to_string_lossy());
        assert_eq!(&*out[0][0].name, anonymous_name(&module, first));
        assert!(is_anonymous(&module, &out[0][0].name));
        assert_eq!(&*out[1][0].name, "named", "a named address keeps its name");
        for name in ["named", "", "prog+0x", "prog+0xg1", "prog2+0x10", "prog+10"] {
            assert!(!is_anonymous("prog", name), "{name}");
        }
        assert!(is_anonymous("prog", "prog+0x1f0"));
    }

    #[test]
    fn only_mangled_names_are_demangled() {
        // C functions whose names are also C++ type codes stay as they are.
        for name in ["a", "b", "c", "i", "v", "main", "_start", "malloc", "_Zfoo"] {
            assert_eq!(demangle(name), name);
        }
        assert_eq!(demangle("_Z3fooi"), "foo(int)");
        assert_eq!(demangle("_ZN3foo3barEv"), "foo::bar()");
        assert_eq!(demangle("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"), "core::ptr::drop_in_place");
        assert_eq!(demangle("_RNvNtCs1234_7mycrate3foo3bar"), "mycrate::foo::bar");
    }

    #[test]
    fn symbolizes_kernel_text() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let addr = kallsyms
            .lines()
            .find_map(|l| {
                let mut parts = l.split_whitespace();
                let addr = u64::from_str_radix(parts.next()?, 16).ok()?;
                let _type = parts.next()?;
                (parts.next()? == "schedule").then_some(addr)
            })
            .filter(|&a| a != 0)
            .expect("schedule in /proc/kallsyms with a real address (tests run as root)");
        let result = Symbolizer::new().kernel(&[addr + 1]);
        assert_eq!(&*result[0].last().unwrap().name, "schedule");
        // The same through a prepared symbolizer on its own thread.
        let background = Background::start();
        background.prepare_kernel();
        let result = background.run(move |s| s.kernel(&[addr + 1])).unwrap();
        assert_eq!(&*result[0].last().unwrap().name, "schedule");
    }

    #[test]
    fn a_prepared_object_symbolizes_on_the_background_thread() {
        let addr = a_function_with_a_distinctive_name() as u64;
        let maps = crate::procfs::Maps::read_self().unwrap();
        let mapping = maps.find(addr).unwrap();
        let offset = mapping.file_offset(addr);
        let background = Background::start();
        background.prepare_object(mapping.path.clone());
        let path = mapping.path.clone();
        let result = background.run(move |s| s.object(&path, &[offset])).unwrap();
        assert!(result[0].last().unwrap().name.contains("a_function_with_a_distinctive_name"), "{result:?}");
    }
}
