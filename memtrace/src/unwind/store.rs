//! The unwind tables of a session, one per file whatever the number of processes mapping
//! it: a slot per file (its index in the probes' tables array), built off the event path
//! by worker threads (or read from the disk cache), then installed in the probes by the
//! thread that owns them ([`TableStore::poll`]). Userspace finishes stack copies with the
//! same tables. Memory is bounded: past the cap a file gets an empty table (its frames end
//! stacks, counted) and a warning names it.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        mpsc::{self, Receiver},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use memtrace_common::{FileId, FileTable, MAX_TABLES, unwind::NO_SLOT};

use super::{
    cache::{DiskCache, FileKey},
    cfi::{Cfi, Segment},
    table::Table,
};

/// A table's place in the probes' tables array.
pub type Slot = u32;

/// What the store knows of a file's table.
#[derive(Clone)]
pub enum TableState {
    Building,
    Ready(Arc<Table>),
}

/// Figures for the summary and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Tables built from call-frame information in this session.
    pub built: u64,
    /// Tables read from the disk cache.
    pub from_cache: u64,
    /// Files without usable call-frame information (their frames end stacks).
    pub without_cfi: u64,
    /// Files refused a table because the memory cap was reached.
    pub over_cap: u64,
    /// Bytes of tables installed in the probes.
    pub bytes: u64,
    /// Rows installed.
    pub rows: u64,
    /// Time spent building (worker threads, all files), and the longest single build.
    pub build_ms: u64,
    pub longest_build_ms: u64,
}

struct Job {
    slot: Slot,
    key: FileKey,
    path: PathBuf,
}

/// The builds waiting for a worker. The newest goes first: a library's code runs right
/// after it is mapped (its initializers, then the calls into it), while the files mapped
/// before it have been running a while, their stacks finished from copies or not needed
/// yet; and a build the probes are waiting for (a stack copy stopped in its file) is moved
/// to the front ([`TableStore::prioritize`]).
#[derive(Default)]
struct JobQueue {
    /// Taken from the back.
    jobs: Vec<Job>,
    closed: bool,
}

/// The queue and the condition its workers wait on.
type SharedQueue = Arc<(Mutex<JobQueue>, Condvar)>;

/// The next job for a worker, waiting for one; None once the store is gone.
fn next_job(queue: &SharedQueue) -> Option<Job> {
    let (lock, ready) = &**queue;
    let mut q = lock.lock().ok()?;
    loop {
        if let Some(job) = q.jobs.pop() {
            return Some(job);
        }
        if q.closed {
            return None;
        }
        q = ready.wait(q).ok()?;
    }
}

struct Done {
    slot: Slot,
    table: Option<Table>,
    from_cache: bool,
    elapsed: Duration,
    path: PathBuf,
}

/// Where tables go once built: the probes' array (the session's `Probes`).
/// Bytes of table elements copied for one batch of installs.
const BATCH_BYTES: usize = 8 << 20;

pub trait TableSink {
    /// Installs each table (its slot, and its elements laid out as the probes read them);
    /// one result per table, in order.
    fn install_tables(&mut self, tables: &[(Slot, Vec<u64>)]) -> Vec<anyhow::Result<()>>;
    /// The same, for a thread of the store's own: the kernel waits for an RCU grace period
    /// (10-30 ms) at each install, and the thread that drains the rings must not wait with
    /// it (the rings fill, stack copies find no room). None: install on the caller's thread.
    fn installer(&self) -> Option<Installer> {
        None
    }
    /// Tells the probes a file's table is installed, so they add its mappings themselves.
    fn register_file(&mut self, _id: FileId, _table: FileTable) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Installs tables from another thread (see [`TableSink::installer`]).
pub type Installer = Box<dyn FnMut(&[(Slot, Vec<u64>)]) -> Vec<anyhow::Result<()>> + Send>;

/// The thread installing tables in the probes: batches in, one answer per table out.
struct InstallThread {
    batches: mpsc::Sender<Vec<(Slot, Arc<Table>)>>,
    answers: Receiver<(Slot, Arc<Table>, anyhow::Result<()>)>,
}

impl InstallThread {
    fn start(mut install: Installer) -> Option<Self> {
        let (batches, batch_rx) = mpsc::channel::<Vec<(Slot, Arc<Table>)>>();
        let (answer_tx, answers) = mpsc::channel();
        std::thread::Builder::new()
            .name("memtrace-install".into())
            .spawn(move || {
                // Ends when the store (the sender) is gone.
                while let Ok(mut batch) = batch_rx.recv() {
                    // Every batch waiting joins this one: the installs of one call share
                    // their grace periods, and batches installed one by one each waited
                    // for their own (a cold start's small libraries queued here ~60 ms).
                    while let Ok(more) = batch_rx.try_recv() {
                        batch.extend(more);
                    }
                    let elements: Vec<(Slot, Vec<u64>)> = batch.iter().map(|(slot, t)| (*slot, t.elements())).collect();
                    let results = install(&elements);
                    drop(elements);
                    for ((slot, table), result) in batch.into_iter().zip(results) {
                        let _ = answer_tx.send((slot, table, result));
                    }
                }
            })
            .ok()?;
        Some(Self { batches, answers })
    }
}

pub struct TableStore {
    slots: HashMap<FileKey, Slot>,
    states: Vec<TableState>,
    /// Files (by path as opened) → their key, so a file seen again is not re-read.
    keys: HashMap<PathBuf, (FileKey, Arc<[Segment]>)>,
    jobs: SharedQueue,
    results: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    /// Tables built but not installed yet.
    ready: Vec<(Slot, Arc<Table>)>,
    /// A path each slot's file was asked for by.
    paths: Vec<PathBuf>,
    /// Installed files not registered with the probes yet (their interpreter's table is
    /// not ready).
    unregistered: Vec<Slot>,
    pending_builds: usize,
    /// The install thread, once a sink offered one, and the tables it holds.
    installing: Option<InstallThread>,
    /// When each slot's table was asked for.
    asked: Vec<Instant>,
    in_flight: usize,
    stats: StoreStats,
    max_bytes: u64,
    warned_cap: bool,
}

/// Default cap on the bytes of tables installed in the probes.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

impl TableStore {
    /// A store with `workers` build threads, reading and filling `cache` if given.
    pub fn new(cache: Option<DiskCache>, workers: usize, max_bytes: u64) -> Self {
        let queue: SharedQueue = Arc::default();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let cache = cache.map(Arc::new);
        // (No worker at all only in tests, to look at the queue.)
        let workers = (0..workers)
            .map(|i| {
                let jobs = Arc::clone(&queue);
                let done = done_tx.clone();
                let cache = cache.clone();
                std::thread::Builder::new()
                    .name(format!("memtrace-unwind-{i}"))
                    .spawn(move || {
                        while let Some(job) = next_job(&jobs) {
                            let started = Instant::now();
                            let (table, from_cache) = build_or_load(&job, cache.as_deref());
                            let _ = done.send(Done {
                                slot: job.slot,
                                table,
                                from_cache,
                                elapsed: started.elapsed(),
                                path: job.path,
                            });
                        }
                    })
                    .expect("spawning an unwind-table worker")
            })
            .collect();
        Self {
            slots: HashMap::new(),
            states: Vec::new(),
            keys: HashMap::new(),
            jobs: queue,
            results: done_rx,
            workers,
            ready: Vec::new(),
            paths: Vec::new(),
            unregistered: Vec::new(),
            pending_builds: 0,
            installing: None,
            asked: Vec::new(),
            in_flight: 0,
            stats: StoreStats::default(),
            max_bytes,
            warned_cap: false,
        }
    }

    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    /// The key and segments of the file at `path` (read once per path).
    pub fn identify(&mut self, path: &Path) -> Option<(FileKey, Arc<[Segment]>)> {
        if let Some(known) = self.keys.get(path) {
            return Some(known.clone());
        }
        let key = FileKey::of(path).ok()?;
        let segments: Arc<[Segment]> = read_segments(path).ok()?.into();
        if self.keys.len() > 16_384 {
            self.keys.clear();
        }
        self.keys.insert(path.to_path_buf(), (key.clone(), Arc::clone(&segments)));
        Some((key, segments))
    }

    /// The slot of the file at `path` (readable from here), building its table if it is
    /// new; None when the file cannot be read or every slot is taken.
    pub fn request(&mut self, path: &Path) -> Option<(Slot, Arc<[Segment]>)> {
        let (key, segments) = self.identify(path)?;
        if let Some(&slot) = self.slots.get(&key) {
            return Some((slot, segments));
        }
        if self.states.len() >= MAX_TABLES as usize {
            return None;
        }
        let slot = self.states.len() as Slot;
        self.states.push(TableState::Building);
        self.paths.push(path.to_path_buf());
        self.asked.push(Instant::now());
        self.slots.insert(key.clone(), slot);
        self.pending_builds += 1;
        let (lock, ready) = &*self.jobs;
        if let Ok(mut q) = lock.lock() {
            q.jobs.push(Job { slot, key, path: path.to_path_buf() });
            ready.notify_one();
        }
        Some((slot, segments))
    }

    /// Moves the build of `slot`, if it has not started, to the front of the queue: a
    /// stack waits for it.
    pub fn prioritize(&mut self, slot: Slot) {
        let (lock, _) = &*self.jobs;
        let Ok(mut q) = lock.lock() else { return };
        if let Some(at) = q.jobs.iter().rposition(|j| j.slot == slot)
            && at + 1 != q.jobs.len()
        {
            let job = q.jobs.remove(at);
            q.jobs.push(job);
        }
    }

    /// The slots waiting for a worker, the next one first (for tests).
    #[cfg(test)]
    fn queued(&self) -> Vec<Slot> {
        self.jobs.0.lock().map(|q| q.jobs.iter().rev().map(|j| j.slot).collect()).unwrap_or_default()
    }

    pub fn state(&self, slot: Slot) -> Option<&TableState> {
        self.states.get(slot as usize)
    }

    /// Whether every table asked for is built and installed.
    pub fn idle(&self) -> bool {
        self.pending_builds == 0 && self.ready.is_empty() && self.in_flight == 0
    }

    /// Takes the builds that finished and installs them through `sink` (on the install
    /// thread when the sink offers one: this call then never waits). Returns how many
    /// tables became ready: userspace finishes stack copies with a table from then on,
    /// the probes once it is installed and registered.
    pub fn poll(&mut self, sink: &mut dyn TableSink) -> usize {
        while let Ok(done) = self.results.try_recv() {
            self.pending_builds = self.pending_builds.saturating_sub(1);
            let ms = done.elapsed.as_millis() as u64;
            let table = match done.table {
                Some(t) => {
                    if done.from_cache {
                        self.stats.from_cache += 1;
                    } else {
                        self.stats.built += 1;
                        self.stats.build_ms += ms;
                        self.stats.longest_build_ms = self.stats.longest_build_ms.max(ms);
                    }
                    log::debug!(
                        "unwind table of {}: {} rows, {} KiB, {} in {ms} ms",
                        done.path.display(),
                        t.rows.len(),
                        t.byte_size() >> 10,
                        if done.from_cache { "from the cache" } else { "built" }
                    );
                    t
                }
                None => {
                    self.stats.without_cfi += 1;
                    log::debug!("{} has no usable call-frame information: its frames end stacks", done.path.display());
                    Table::from_rows(&[], Vec::new())
                }
            };
            let table = if self.stats.bytes + table.byte_size() as u64 > self.max_bytes {
                self.stats.over_cap += 1;
                if !self.warned_cap {
                    self.warned_cap = true;
                    eprintln!(
                        "memtrace: warning: unwind tables reached {} MiB: stacks through {} and later files are cut short there",
                        self.max_bytes >> 20,
                        done.path.display()
                    );
                }
                Table::from_rows(&[], Vec::new())
            } else {
                table
            };
            self.ready.push((done.slot, Arc::new(table)));
        }
        if self.installing.is_none() {
            self.installing = sink.installer().and_then(InstallThread::start);
        }
        let mut installed = 0;
        let mut ready = std::mem::take(&mut self.ready).into_iter().peekable();
        while ready.peek().is_some() {
            // A batch is installed at once (the sink overlaps the kernel's waits); its
            // elements are copies, so a batch is bounded in bytes.
            let mut batch = Vec::new();
            let mut bytes = 0;
            while let Some((slot, table)) =
                ready.next_if(|(_, t)| batch.is_empty() || bytes + t.byte_size() <= BATCH_BYTES)
            {
                bytes += table.byte_size();
                batch.push((slot, table));
            }
            match &self.installing {
                Some(thread) => {
                    // Userspace finishes copies with them at once.
                    for (slot, table) in &batch {
                        if let Some(state) = self.states.get_mut(*slot as usize) {
                            *state = TableState::Ready(Arc::clone(table));
                        }
                    }
                    installed += batch.len();
                    self.in_flight += batch.len();
                    if let Err(mpsc::SendError(batch)) = thread.batches.send(batch) {
                        self.in_flight -= batch.len();
                        self.installing = None;
                        self.install_batch(batch, sink);
                    }
                }
                None => installed += self.install_batch(batch, sink),
            }
        }
        if let Some(thread) = &self.installing {
            let answers: Vec<_> = thread.answers.try_iter().collect();
            for (slot, table, result) in answers {
                self.in_flight = self.in_flight.saturating_sub(1);
                self.installed(slot, table, result);
            }
        }
        if !self.unregistered.is_empty() {
            for slot in std::mem::take(&mut self.unregistered) {
                if !self.register(slot, sink) {
                    self.unregistered.push(slot);
                }
            }
        }
        installed
    }

    /// Installs `batch` through `sink`; returns how many tables it held.
    fn install_batch(&mut self, batch: Vec<(Slot, Arc<Table>)>, sink: &mut dyn TableSink) -> usize {
        let elements: Vec<(Slot, Vec<u64>)> = batch.iter().map(|(slot, table)| (*slot, table.elements())).collect();
        let results = sink.install_tables(&elements);
        drop(elements);
        let mut installed = 0;
        for ((slot, table), result) in batch.into_iter().zip(results) {
            self.installed(slot, table, result);
            installed += 1;
        }
        installed
    }

    /// Counts a table installed in the probes (or not), marks it ready and queues its
    /// file's registration.
    fn installed(&mut self, slot: Slot, table: Arc<Table>, result: anyhow::Result<()>) {
        match result {
            Ok(()) => {
                self.stats.bytes += table.byte_size() as u64;
                self.stats.rows += table.rows.len() as u64;
            }
            Err(e) => log::warn!("installing the unwind table in slot {slot}: {e:#}"),
        }
        // Userspace finishes copies with it either way.
        if let Some(state) = self.states.get_mut(slot as usize) {
            *state = TableState::Ready(table);
        }
        self.unregistered.push(slot);
    }

    /// Registers the file of `slot` with the probes: its identity, where its code lies,
    /// and its interpreter's table. False when that table is not ready yet.
    fn register(&mut self, slot: Slot, sink: &mut dyn TableSink) -> bool {
        let Some(path) = self.paths.get(slot as usize).cloned() else { return true };
        let Some(TableState::Ready(table)) = self.state(slot).cloned() else { return true };
        let Some(id) = kernel_file_id(&path) else { return true };
        let Some(text) = table.segments.iter().filter(|s| s.executable).min_by_key(|s| s.vaddr).copied() else {
            return true; // an empty table (no call-frame information): nothing to walk
        };
        let mut entry = FileTable {
            slot,
            interp_slot: NO_SLOT,
            delta: text.vaddr.wrapping_sub(text.file_offset),
            exec_vaddr: text.vaddr,
            exec_size: text.file_size,
            interp_exec_vaddr: 0,
            interp_exec_size: 0,
        };
        if let Some(interp) = crate::elf::ElfFile::open(&path).ok().and_then(|e| e.interpreter()) {
            // The interpreter as the program will see it: under the same root.
            let interp = match path.to_str().and_then(|p| p.strip_prefix("/proc/")).and_then(|p| p.split_once("/root/"))
            {
                Some((pid, _)) => PathBuf::from(format!("/proc/{pid}/root{interp}")),
                None => PathBuf::from(interp),
            };
            if let Some((interp_slot, _)) = self.request(&interp) {
                match self.state(interp_slot) {
                    Some(TableState::Ready(t)) => {
                        if let Some(text) = t.segments.iter().filter(|s| s.executable).min_by_key(|s| s.vaddr) {
                            entry.interp_slot = interp_slot;
                            entry.interp_exec_vaddr = text.vaddr;
                            entry.interp_exec_size = text.file_size;
                        }
                    }
                    _ => return false,
                }
            }
        }
        log::debug!(
            "unwind table of {} in the probes {} ms after it was asked for",
            path.display(),
            self.asked.get(slot as usize).map_or(0, |t| t.elapsed().as_millis())
        );
        if let Err(e) = sink.register_file(id, entry) {
            log::debug!("registering the unwind table of {}: {e:#}", path.display());
        }
        true
    }

    /// Waits until every requested table is installed, or `timeout` passes.
    pub fn wait_idle(&mut self, sink: &mut dyn TableSink, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll(sink);
            if self.idle() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for TableStore {
    fn drop(&mut self) {
        // Closing the queue ends the workers once their current build is done; they are
        // not joined (a huge build must not delay the exit).
        let (lock, ready) = &*self.jobs;
        if let Ok(mut q) = lock.lock() {
            q.closed = true;
            q.jobs.clear();
        }
        ready.notify_all();
        self.workers.clear();
    }
}

/// A file's identity as the kernel gives it (`s_dev` in the kernel's encoding, inode).
pub fn kernel_file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt as _;
    let md = std::fs::metadata(path).ok()?;
    let dev = md.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    Some(FileId { dev: (major << 20) | (minor & 0xf_ffff), _pad: 0, ino: md.ino() })
}

/// The loadable segments of an ELF file (program headers only: cheap).
pub fn read_segments(path: &Path) -> anyhow::Result<Vec<Segment>> {
    let file = std::fs::File::open(path)?;
    // SAFETY: read-only private mapping while the headers are parsed.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    let elf = object::File::parse(&*map)?;
    Ok(super::cfi::segments_of(&elf))
}

fn build_or_load(job: &Job, cache: Option<&DiskCache>) -> (Option<Table>, bool) {
    if let Some(cache) = cache {
        match cache.load(&job.key) {
            Ok(table) => return (Some(table), true),
            Err(why) => {
                if why != super::cache::Rejected::Missing {
                    log::debug!("unwind cache entry for {} ({}): {why}; rebuilding", job.path.display(), job.key);
                }
            }
        }
    }
    let Ok(cfi) = Cfi::open(&job.path) else { return (None, false) };
    let rows = cfi.rows();
    if rows.is_empty() {
        return (None, false);
    }
    let table = Table::from_rows(&rows, cfi.segments);
    if let Some(cache) = cache
        && let Err(e) = cache.store(&job.key, &table)
    {
        log::debug!("storing the unwind table of {} in the cache: {e}", job.path.display());
    }
    (Some(table), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Installed(Vec<(Slot, usize)>);
    impl TableSink for Installed {
        fn install_tables(&mut self, tables: &[(Slot, Vec<u64>)]) -> Vec<anyhow::Result<()>> {
            self.0.extend(tables.iter().map(|(slot, elements)| (*slot, elements.len())));
            tables.iter().map(|_| Ok(())).collect()
        }
    }

    #[test]
    fn a_file_gets_one_slot_and_one_build() {
        let exe = std::env::current_exe().unwrap();
        let mut store = TableStore::new(None, 2, DEFAULT_MAX_BYTES);
        let (slot, segments) = store.request(&exe).unwrap();
        assert!(!segments.is_empty());
        assert_eq!(store.request(&exe).unwrap().0, slot, "the same file, the same slot");
        let mut sink = Installed::default();
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        // The program's table, installed once (and its interpreter's, which registering the
        // program with the probes asks for).
        assert_eq!(sink.0.iter().filter(|(s, _)| *s == slot).count(), 1);
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        assert_eq!(store.stats().built, sink.0.len() as u64);
        let Some(TableState::Ready(table)) = store.state(slot) else { panic!("not ready") };
        assert!(table.rows.len() > 1000);
    }

    #[test]
    fn the_newest_build_goes_first_and_a_build_waited_for_goes_before_it() {
        let mut store = TableStore::new(None, 0, DEFAULT_MAX_BYTES);
        let files = [std::env::current_exe().unwrap(), "/bin/true".into(), "/bin/sh".into()];
        let slots: Vec<Slot> = files.iter().map(|f| store.request(f).unwrap().0).collect();
        assert_eq!(store.queued(), [slots[2], slots[1], slots[0]]);
        store.prioritize(slots[0]);
        assert_eq!(store.queued(), [slots[0], slots[2], slots[1]]);
        store.prioritize(slots[0]);
        store.prioritize(99);
        assert_eq!(store.queued(), [slots[0], slots[2], slots[1]], "nothing else moves");
    }

    #[test]
    fn the_cap_gives_an_empty_table_and_files_without_cfi_too() {
        let exe = std::env::current_exe().unwrap();
        let mut store = TableStore::new(None, 1, 1024);
        let (slot, _) = store.request(&exe).unwrap();
        let not_elf = std::env::temp_dir().join(format!("memtrace-not-elf-{}", std::process::id()));
        std::fs::write(&not_elf, b"not an ELF file").unwrap();
        assert!(store.request(&not_elf).is_none(), "a file that is not ELF has no segments");
        let mut sink = Installed::default();
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        assert_eq!(store.stats().over_cap, 1);
        let Some(TableState::Ready(table)) = store.state(slot) else { panic!() };
        assert!(table.rows.is_empty());
    }
}
