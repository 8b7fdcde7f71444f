//! The recorded stacks, named: turns a stack id into frames (kernel part trimmed to start at
//! the allocation's caller, then the user part), each with function, inline chain, source
//! location and module. Names come from the recording's symbol table; when the recording
//! has none (memtrace stopped abruptly), from the local files and kernel, once per
//! distinct address.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    path::Path,
    sync::Arc,
};

use serde::Serialize;

use crate::{
    analysis::Domain,
    recording::{FileFrame, FileStack, Module, Symbol, SymbolKey},
    stack_store::{Frame as StoreFrame, StackRef, StackStore},
    symbolize::Symbolizer,
};

/// One named frame. In JSON its `kind` says `native`, `python` or `kernel`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Shared with every frame of the same symbol (and `module` with every frame of the
    /// same file): a report by stack of a heavy program names a million frames, which held
    /// a copy of each name apiece.
    pub function: Arc<str>,
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
    /// Object file (path or name) for user frames, "[kernel]" for kernel frames.
    pub module: Arc<str>,
    /// Offset in the module (user) or address (kernel). In JSON a `"0x…"` string: as a
    /// number, a kernel address (above 2^53) would lose bits in jq and JavaScript.
    pub address: u64,
    pub kernel: bool,
    /// A Python function (its line is `line`; `module` is its file).
    pub python: bool,
    /// Inlined into the frame that follows.
    pub inlined: bool,
    /// No symbol was found: `function` is `module+0xoffset` (the offset where the function
    /// starts, when the file's call-frame information tells, else the frame's) or an
    /// address.
    pub unknown: bool,
    /// An allocation wrapper's ([`crate::wrappers`]): a site is named after the first
    /// user frame that is not one.
    pub wrapper: bool,
}

impl fmt::Display for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.function)?;
        if let (Some(file), Some(line)) = (&self.file, self.line) {
            let short = Path::new(&**file).file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
            write!(f, " ({short}:{line})")?;
        }
        if self.inlined {
            f.write_str(" [inlined]")?;
        }
        Ok(())
    }
}

impl Frame {
    /// What the frame is: `native`, `python` or `kernel`.
    pub fn kind(&self) -> &'static str {
        if self.kernel {
            "kernel"
        } else if self.python {
            "python"
        } else {
            "native"
        }
    }
}

impl Serialize for Frame {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut st = s.serialize_struct("Frame", 10)?;
        st.serialize_field("function", &*self.function)?;
        if let Some(file) = &self.file {
            st.serialize_field("file", &**file)?;
        }
        if let Some(line) = self.line {
            st.serialize_field("line", &line)?;
        }
        st.serialize_field("module", &*self.module)?;
        st.serialize_field("address", &format!("0x{:x}", self.address))?;
        st.serialize_field("kind", self.kind())?;
        st.serialize_field("kernel", &self.kernel)?;
        st.serialize_field("inlined", &self.inlined)?;
        st.serialize_field("unknown", &self.unknown)?;
        st.serialize_field("wrapper", &self.wrapper)?;
        st.end()
    }
}

pub fn module_name(path: &str) -> String {
    Path::new(path).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.to_string())
}

#[derive(Default)]
pub struct StackTable {
    stacks: StackStore,
    pub modules: BTreeMap<u32, Module>,
    /// Changed after the table is made through [`Self::extend_symbols`],
    /// [`Self::clear_symbols`] and [`Self::fill_missing_symbols`], which keep
    /// `wrapper_frames` with it.
    pub symbols: HashMap<SymbolKey, Vec<Symbol>>,
    /// Names computed for (stack id, call site).
    cache: HashMap<(u64, u64), Vec<Frame>>,
    /// The allocator's object, whose own mmaps are reserved memory ([`Self::set_allocator`]).
    allocator: Option<String>,
    /// The allocation wrappers a site is named past ([`Self::set_alloc_fns`]).
    alloc_fns: crate::wrappers::AllocFns,
    /// Per user address with a wrapper's frame in its inline chain: which of its frames
    /// are wrappers'. Kept with [`Self::symbols`] (changed through the methods that keep
    /// it), so that naming a stack matches no name again.
    wrapper_frames: HashMap<SymbolKey, Vec<bool>>,
    /// The names of the modules as frames show them ([`Self::module_name`]), kept once a
    /// module's path is known (a path, once learned, does not change).
    module_names: std::sync::Mutex<HashMap<u32, Arc<str>>>,
}

/// [`StackTable::module_name`]'s ids for kernel frames and user frames of no module: no
/// recording numbers that many modules.
const KERNEL_MODULE: u32 = u32::MAX;
const UNKNOWN_MODULE: u32 = u32::MAX - 1;

/// Most user addresses of allocation wrappers a site is named past: more than a stack
/// holds (511 user frames), so that a row's key and its whole stack's first frame agree
/// (a copy of a big `std::map` recurses 33 addresses deep in the library).
const MAX_WRAPPER_ADDRESSES: usize = 1024;

/// Functions of the page allocator: a page allocation's site is the first frame outside
/// them, as a user allocation's is the caller of malloc.
const PAGE_ALLOCATOR: &[&str] = &[
    "__alloc_pages",
    "__alloc_frozen_pages",
    "alloc_pages",
    "alloc_frozen_pages",
    "__folio_alloc",
    "folio_alloc",
    "vma_alloc_folio",
    "__get_free_pages",
    "get_free_pages",
    "get_zeroed_page",
    "alloc_pages_exact",
    "get_page_from_freelist",
    "rmqueue",
    "__rmqueue",
    "post_alloc_hook",
    "prep_new_page",
];

/// Whether a kernel function belongs to the page allocator (`alloc_pages_mpol`,
/// `__alloc_frozen_pages_noprof`, `folio_alloc_mpol_noprof.isra.0`).
pub fn is_page_allocator(function: &str) -> bool {
    let base = function.split('.').next().unwrap_or(function);
    PAGE_ALLOCATOR.iter().any(|p| base == *p || base.strip_prefix(p).is_some_and(|rest| rest.starts_with('_')))
}

/// Kernel functions of the uprobe machinery: what is allocated under them is allocated for
/// a tracer's probes (memtrace's, or another uprobe user's), not by the traced program —
/// the copy of a page a breakpoint is written into, a return probe's instance, the
/// `[uprobes]` page, a task's uprobe state.
const UPROBE_MACHINERY: &[&str] = &[
    "uprobe_mmap",
    "install_breakpoint",
    "uprobe_write_opcode",
    "uprobe_write",
    "uprobe_notify_resume",
    "handle_swbp",
    "handler_chain",
    "prepare_uretprobe",
    "uprobe_handle_trampoline",
    "uprobe_dup_mmap",
    "uprobe_copy_process",
    "dup_utask",
    "get_utask",
    "get_xol_area",
    "xol_add_vma",
    "__create_xol_area",
    "register_for_each_vma",
];

/// Whether a kernel function belongs to the uprobe machinery (`handle_swbp`,
/// `uprobe_write_opcode.isra.0`).
pub fn is_uprobe_machinery(function: &str) -> bool {
    let base = function.split('.').next().unwrap_or(function);
    UPROBE_MACHINERY.contains(&base)
}

/// Kernel functions through which the slab allocators take pages from the page allocator:
/// a new slab of a cache (`allocate_slab`), and a kmalloc too large for any cache, which
/// the page allocator serves whole. The objects in those pages are counted at their own
/// kmalloc or kmem_cache_alloc.
const SLAB_PAGE_TAKERS: &[&str] = &["allocate_slab", "alloc_slab_page", "___kmalloc_large_node", "kmalloc_large_node"];

/// Whether a kernel function takes pages for the slab allocators (`allocate_slab`).
pub fn is_slab_page_taker(function: &str) -> bool {
    let base = function.split('.').next().unwrap_or(function);
    SLAB_PAGE_TAKERS.contains(&base)
}

/// Functions of a C library or allocator linked into a program (no library to tell them
/// by) that map memory for themselves: thread stacks, malloc's heaps and arenas.
const ALLOCATOR_MAPPERS: &[&str] = &[
    "allocate_stack",
    "__pthread_create_2_1",
    "pthread_create",
    "new_heap",
    "alloc_new_heap",
    "sysmalloc",
    "sysmalloc_mmap",
    "sysmalloc_mmap_fallback",
    "_int_new_arena",
    "arena_get2",
    "__spawni",
    "__spawnix",
];

/// The functions jemalloc, mimalloc and tcmalloc map their pages with, under any prefix
/// (`je_pages_map`, `_rjem_je_pages_map`): their mmaps are the allocator's reserve, even
/// where the recording's allocator is another one (the C library's, beside a jemalloc
/// linked into the program).
const ALLOCATOR_PAGE_MAPPERS: &[&str] =
    &["pages_map", "os_pages_map", "mi_unix_mmap", "_mi_prim_alloc", "tcmalloc::MmapSysAllocator::Alloc"];

/// Suffixes GCC gives the clones of a function it specializes or splits
/// (`os_pages_map.constprop.0`, `foo.isra.0`, `foo.part.0`, `foo.cold`), and LLVM's.
const CLONE_SUFFIXES: &[&str] = &["constprop", "isra", "part", "cold", "lto_priv", "llvm"];

fn is_allocator_pages_map(function: &str) -> bool {
    let base = function.split('(').next().unwrap_or(function);
    // A clone is its function (jemalloc linked statically: `os_pages_map.constprop.0`).
    let base = match base.split_once('.') {
        Some((name, clone)) if CLONE_SUFFIXES.iter().any(|c| clone.starts_with(c)) => name,
        _ => base,
    };
    ALLOCATOR_PAGE_MAPPERS
        .iter()
        .any(|m| base == *m || base.strip_suffix(m).is_some_and(|prefix| prefix.ends_with('_')))
}

impl StackTable {
    pub fn new(
        stacks: impl IntoIterator<Item = (u32, FileStack)>,
        modules: BTreeMap<u32, Module>,
        symbols: impl IntoIterator<Item = (SymbolKey, Vec<Symbol>)>,
    ) -> Self {
        let mut store = StackStore::default();
        for (_, s) in stacks {
            store.insert(&s);
        }
        Self::with_store(store, modules, symbols)
    }

    /// A table of the stacks in `store` (done adding: [`StackStore::settle`]).
    pub fn with_store(
        mut store: StackStore,
        modules: BTreeMap<u32, Module>,
        symbols: impl IntoIterator<Item = (SymbolKey, Vec<Symbol>)>,
    ) -> Self {
        store.settle();
        Self {
            stacks: store,
            modules,
            symbols: symbols.into_iter().collect(),
            cache: HashMap::new(),
            allocator: None,
            alloc_fns: Default::default(),
            wrapper_frames: HashMap::new(),
            module_names: Default::default(),
        }
        .indexed()
    }

    /// Adds (or replaces) a stack.
    pub fn insert_stack(&mut self, s: FileStack) {
        self.stacks.insert(&s);
    }

    /// Forgets a stack (the agent's eviction).
    pub fn remove_stack(&mut self, id: u32) {
        self.stacks.remove(id);
        self.cache.retain(|&(stack, _), _| stack != u64::from(id) + 1);
    }

    pub fn stack_count(&self) -> usize {
        self.stacks.len()
    }

    /// Every stack: (id, pid, cut short), by id.
    pub fn stack_list(&self) -> Vec<(u32, u32, bool)> {
        self.stacks.iter().map(|s| (s.id, s.pid, s.truncated)).collect()
    }

    /// The stack events refer to as `stack` (id + 1).
    pub fn stack(&self, stack: u64) -> Option<StackRef<'_>> {
        stack.checked_sub(1).and_then(|id| self.stacks.get(u32::try_from(id).ok()?))
    }

    /// Every address the stacks name (each once): kernel addresses, and user frames in a
    /// module.
    pub fn symbol_keys(&self) -> impl Iterator<Item = SymbolKey> + '_ {
        self.stacks.distinct_frames().filter_map(|f| match f {
            StoreFrame::Kernel(a) => Some(SymbolKey::Kernel(a)),
            StoreFrame::User(f @ FileFrame::Module { .. }) => Some(SymbolKey::User(f)),
            StoreFrame::User(FileFrame::Address(_)) => None,
        })
    }

    /// Forgets the names computed for rows, so they are named again from the symbols.
    pub fn clear_names(&mut self) {
        self.cache.clear();
    }

    /// The object the recording's allocator was found in (its `allocator`), to tell the
    /// mmaps it makes for itself ([`Self::is_reserved_mmap`]).
    pub fn set_allocator(&mut self, object: Option<&str>) {
        self.allocator = object.map(module_name);
    }

    /// The allocation wrappers sites are named past (`--alloc-fn`; the built-in ones by
    /// default).
    pub fn set_alloc_fns(&mut self, fns: crate::wrappers::AllocFns) {
        if fns != self.alloc_fns {
            self.alloc_fns = fns;
            self.cache.clear();
            self.wrapper_frames.clear();
            let keys: Vec<SymbolKey> = self.symbols.keys().copied().collect();
            self.index_wrappers(keys);
        }
    }

    /// Adds symbols (the agent's namer).
    pub fn extend_symbols(&mut self, found: Vec<(SymbolKey, Vec<Symbol>)>) {
        let keys: Vec<SymbolKey> = found.iter().map(|(k, _)| *k).collect();
        self.symbols.extend(found);
        self.index_wrappers(keys);
    }

    /// Forgets every symbol (the agent's bound on them).
    pub fn clear_symbols(&mut self) {
        self.symbols.clear();
        self.wrapper_frames.clear();
    }

    fn indexed(mut self) -> Self {
        let keys: Vec<SymbolKey> = self.symbols.keys().copied().collect();
        self.index_wrappers(keys);
        self
    }

    /// Notes which frames of these addresses' symbols are allocation wrappers'.
    fn index_wrappers(&mut self, keys: Vec<SymbolKey>) {
        for key in keys {
            let flags: Vec<bool> = match (key, self.symbols.get(&key)) {
                (SymbolKey::User(_), Some(chain)) => {
                    chain.iter().map(|s| self.alloc_fns.matches_frame(&s.name, s.file.as_deref())).collect()
                }
                _ => Vec::new(),
            };
            if flags.contains(&true) {
                self.wrapper_frames.insert(key, flags);
            } else {
                self.wrapper_frames.remove(&key);
            }
        }
    }

    /// Whether every frame at this user address (its inline chain) is an allocation
    /// wrapper's: a site is named past it.
    fn is_wrapper_address(&self, frame: FileFrame) -> bool {
        self.wrapper_frames.get(&SymbolKey::User(frame)).is_some_and(|flags| flags.iter().all(|&w| w))
    }

    /// How many of a stack's first user addresses are allocation wrappers' alone (with the
    /// unnamed ones between them: a wrapper's static helper without a symbol, as sqlite's
    /// `sqlite3MemMalloc` under `sqlite3Malloc`): the names of a prefix start after them.
    /// [`crate::grouping::first_frame`] skips the same frames of a whole stack.
    fn wrapper_addresses(&self, s: &StackRef<'_>) -> usize {
        let mut skipped = 0;
        for (i, f) in s.user().take(MAX_WRAPPER_ADDRESSES).enumerate() {
            if self.is_wrapper_address(f) {
                skipped = i + 1;
            } else if !self.is_unnamed_address(f) {
                break;
            }
        }
        skipped
    }

    /// Whether a user address has no name ([`Self::name`] makes it `module+0x…` or
    /// `[unknown] 0x…`): no symbol, or only where its function starts, and not a Python
    /// function.
    fn is_unnamed_address(&self, frame: FileFrame) -> bool {
        match frame {
            FileFrame::Address(_) => true,
            FileFrame::Module { module, .. } => {
                self.symbols.get(&SymbolKey::User(frame)).is_none_or(|chain| match &chain[..] {
                    [] => true,
                    // A function named only by where it starts.
                    [only] => {
                        only.file.is_none() && crate::symbolize::is_anonymous(&self.module_name(module), &only.name)
                    }
                    _ => false,
                }) && self.modules.get(&module).is_none_or(|m| crate::python::function_of(m).is_none())
            }
        }
    }

    /// Whether an mmap with this stack is memory the C library or allocator reserved for
    /// itself (a thread stack, a malloc arena), not the program's own mapping: its first
    /// user frame is inside the allocator's library, or, for an allocator linked into the
    /// program, in one of the functions known to map for themselves.
    pub fn is_reserved_mmap(&self, stack: u64) -> bool {
        let Some(s) = self.stack(stack) else { return false };
        // Only the innermost user frame is named: not the whole stack, which a recording
        // of a big program would otherwise build (and keep) for each of its stacks.
        let Some(innermost) = s.user().next() else { return false };
        let chain = self.name(SymbolKey::User(innermost));
        let Some(first) = chain.first() else { return false };
        // Any allocator's own page mapping, wherever it is linked (jemalloc in rustc).
        if is_allocator_pages_map(&first.function) {
            return true;
        }
        let Some(allocator) = self.allocator.as_deref() else { return false };
        if allocator.contains(".so") {
            *first.module == *allocator
        } else {
            *first.module == *allocator && ALLOCATOR_MAPPERS.contains(&&*first.function)
        }
    }

    /// Every stack (id + 1) whose mmaps are reserved memory.
    pub fn reserved_stacks(&self) -> HashSet<u64> {
        self.stacks.iter().map(|s| u64::from(s.id) + 1).filter(|&s| self.is_reserved_mmap(s)).collect()
    }

    /// Every stack (id + 1) with a kernel frame in the uprobe machinery
    /// ([`is_uprobe_machinery`]), or whose user code was the uprobes' own page (`[uprobes]`:
    /// the return trampoline and the out-of-line slots, whose first run in a process faults
    /// in page tables): allocations the probes caused, counted apart. Each kernel address
    /// is looked up once, by its symbols alone.
    pub fn uprobe_stacks(&self) -> HashSet<u64> {
        let in_uprobes_page = |f: FileFrame| matches!(f, FileFrame::Address(a) if crate::overhead::in_uprobes_page(a));
        self.stacks_through(is_uprobe_machinery, |s| s.user().next().is_some_and(in_uprobes_page))
    }

    /// Every stack (id + 1) through a kernel function that takes pages for the slab
    /// allocators ([`is_slab_page_taker`]): page allocations whose memory is counted again
    /// at each object's own kmalloc or kmem_cache_alloc.
    pub fn slab_page_stacks(&self) -> HashSet<u64> {
        self.stacks_through(is_slab_page_taker, |_| false)
    }

    /// Every stack (id + 1) with a kernel frame named as `function` says, or for which
    /// `also` holds. Each kernel address is looked up once, by its symbols alone.
    fn stacks_through(
        &self,
        function: impl Fn(&str) -> bool,
        also: impl Fn(&crate::stack_store::StackRef<'_>) -> bool,
    ) -> HashSet<u64> {
        let mut named: HashMap<u64, bool> = HashMap::new();
        let mut out = HashSet::new();
        for s in self.stacks.iter() {
            let hit = also(&s)
                || s.kernel().any(|addr| {
                    *named.entry(addr).or_insert_with(|| {
                        self.symbols
                            .get(&SymbolKey::Kernel(addr))
                            .is_some_and(|chain| chain.iter().any(|sym| function(&sym.name)))
                    })
                });
            if hit {
                out.insert(u64::from(s.id) + 1);
            }
        }
        out
    }

    /// Stacks recorded under more than one id with the same frames (a stack finished from a
    /// copy is defined under the event's own id) → the first such id, as events refer to
    /// stacks (id + 1). A stack is one row, however many ids it was recorded under.
    pub fn duplicates(&self) -> HashMap<u64, u64> {
        self.stacks.duplicates().into_iter().map(|(id, first)| (u64::from(id) + 1, u64::from(first) + 1)).collect()
    }

    /// Symbolizes locally every frame the recording has no symbol for. Returns how many
    /// addresses were named that way.
    pub fn fill_missing_symbols(&mut self) -> usize {
        let mut by_module: HashMap<u32, HashSet<u64>> = HashMap::new();
        let mut kernel: HashSet<u64> = HashSet::new();
        for key in self.symbol_keys() {
            if self.symbols.contains_key(&key) {
                continue;
            }
            match key {
                SymbolKey::Kernel(addr) => {
                    kernel.insert(addr);
                }
                SymbolKey::User(FileFrame::Module { module, offset })
                    if self.modules.get(&module).is_none_or(|m| crate::python::function_of(m).is_none()) =>
                {
                    by_module.entry(module).or_default().insert(offset);
                }
                SymbolKey::User(_) => {}
            }
        }
        if by_module.is_empty() && kernel.is_empty() {
            return 0;
        }
        let symbolizer = Symbolizer::new();
        let mut named = 0;
        // The user addresses named here: only theirs are looked at for wrappers.
        let mut added = Vec::new();
        for (module, offsets) in by_module {
            let Some(m) = self.modules.get(&module) else {
                continue;
            };
            let path = Path::new(&m.path);
            // Only a file with the recorded build id describes these offsets.
            if m.path.is_empty()
                || (!m.build_id.is_empty() && crate::elf::build_id(path).as_deref() != Some(&m.build_id[..]))
            {
                continue;
            }
            let offsets: Vec<u64> = offsets.into_iter().collect();
            let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
            for (offset, syms) in offsets.iter().zip(symbolizer.object(path, &lookups)) {
                if !syms.is_empty() {
                    named += 1;
                    let key = SymbolKey::User(FileFrame::Module { module, offset: *offset });
                    self.symbols.insert(key, syms);
                    added.push(key);
                }
            }
        }
        let addrs: Vec<u64> = kernel.into_iter().collect();
        let lookups: Vec<u64> = addrs.iter().map(|a| a.saturating_sub(1)).collect();
        for (addr, syms) in addrs.iter().zip(symbolizer.kernel(&lookups)) {
            if !syms.is_empty() {
                named += 1;
                self.symbols.insert(SymbolKey::Kernel(*addr), syms);
            }
        }
        self.cache.clear();
        self.index_wrappers(added);
        named
    }

    /// The name frames of module `id` show (or of [`KERNEL_MODULE`], [`UNKNOWN_MODULE`]),
    /// made once and shared by them.
    fn module_name(&self, id: u32) -> Arc<str> {
        let module = self.modules.get(&id);
        // A Python module's path is its file (possibly empty), whatever it holds.
        let named = |m: &Module| !m.path.is_empty() || crate::python::function_of(m).is_some();
        match module {
            // Not kept: `top` and `serve` may learn the module, or its path, later.
            None if id != KERNEL_MODULE && id != UNKNOWN_MODULE => return "[unknown module]".into(),
            Some(m) if !named(m) => return format!("[build-id {}]", hex(&m.build_id)).into(),
            _ => {}
        }
        let mut names = self.module_names.lock().unwrap_or_else(|e| e.into_inner());
        let name = names.entry(id).or_insert_with(|| match module {
            Some(m) => module_name(&m.path).into(),
            None if id == KERNEL_MODULE => "[kernel]".into(),
            None => "[unknown]".into(),
        });
        Arc::clone(name)
    }

    /// The frames of one address: the inline chain, innermost first.
    fn name(&self, key: SymbolKey) -> Vec<Frame> {
        if let SymbolKey::User(FileFrame::Module { module, offset }) = key
            && let Some(m) = self.modules.get(&module)
            && let Some(function) = crate::python::function_of(m)
        {
            return vec![Frame {
                function: function.into(),
                file: Some(m.path.as_str().into()),
                line: u32::try_from(offset).ok().filter(|&l| l != 0),
                module: self.module_name(module),
                address: offset,
                kernel: false,
                python: true,
                inlined: false,
                unknown: false,
                wrapper: false,
            }];
        }
        let (kernel, address, module) = match key {
            SymbolKey::Kernel(addr) => (true, addr, self.module_name(KERNEL_MODULE)),
            SymbolKey::User(FileFrame::Module { module, offset }) => (false, offset, self.module_name(module)),
            SymbolKey::User(FileFrame::Address(ip)) => (false, ip, self.module_name(UNKNOWN_MODULE)),
        };
        let wrappers = self.wrapper_frames.get(&key);
        match self.symbols.get(&key) {
            Some(chain) if !chain.is_empty() => chain
                .iter()
                .enumerate()
                .map(|(i, s)| Frame {
                    function: s.name.clone(),
                    file: s.file.clone(),
                    line: (s.line != 0).then_some(s.line),
                    module: module.clone(),
                    address,
                    kernel,
                    python: false,
                    inlined: s.inlined,
                    // A function named only by where it starts (a stripped library's).
                    unknown: !kernel && s.file.is_none() && crate::symbolize::is_anonymous(&module, &s.name),
                    wrapper: wrappers.and_then(|w| w.get(i)).copied().unwrap_or(false),
                })
                .collect(),
            _ => vec![Frame {
                function: if kernel {
                    format!("0x{address:x}")
                } else if matches!(key, SymbolKey::User(FileFrame::Address(_))) {
                    format!("[unknown] 0x{address:x}")
                } else {
                    format!("{module}+0x{address:x}")
                }
                .into(),
                file: None,
                line: None,
                module,
                address,
                kernel,
                python: false,
                inlined: false,
                unknown: true,
                wrapper: false,
            }],
        }
    }

    /// The named frames of an allocation, innermost first: the kernel part (starting at
    /// `call_site` when it is on the stack), then the user part. Falls back to the call
    /// site alone when the stack is unknown. Kept for the next call (`top` and `serve` name
    /// the same rows again and again).
    pub fn frames(&mut self, stack: u64, call_site: u64) -> Vec<Frame> {
        if let Some(f) = self.cache.get(&(stack, call_site)) {
            return f.clone();
        }
        let out = self.named(stack, call_site, usize::MAX);
        self.cache.insert((stack, call_site), out.clone());
        out
    }

    /// [`Self::frames`], not kept: a report names each of its rows once.
    pub fn frames_once(&self, stack: u64, call_site: u64) -> Vec<Frame> {
        self.named(stack, call_site, usize::MAX)
    }

    /// The first frames of [`Self::frames`]: the whole kernel part and the names of the
    /// first `user` addresses of the user part (not kept). A report names its rows from
    /// these before it knows which rows it shows: a label shows three frames, and naming
    /// every frame of every stack of a heavy program took gigabytes.
    pub fn frames_prefix(&self, stack: u64, call_site: u64, user: usize) -> Vec<Frame> {
        self.named(stack, call_site, user)
    }

    /// The frame a row of `domain` is named after ([`crate::grouping::first_frame`] of
    /// [`Self::frames`]), or with `python` the stack's first Python frame if it has one,
    /// naming no other user frame.
    pub fn key_frame(&self, stack: u64, call_site: u64, domain: Domain, python: bool) -> Option<Frame> {
        if python
            && let Some(s) = self.stack(stack)
            && let Some(frame) = s.user().find(|f| {
                matches!(f, FileFrame::Module { module, .. }
                    if self.modules.get(module).is_some_and(|m| crate::python::function_of(m).is_some()))
            })
        {
            return self.name(SymbolKey::User(frame)).into_iter().next();
        }
        crate::grouping::first_frame(domain, &self.named(stack, call_site, 1)).cloned()
    }

    /// What the names [`Self::frames_prefix`] gives with `user` depend on, as numbers: two
    /// stacks with the same key name the same frames there, so a row's label is named once
    /// per key, not once per stack. A user row's key is its first `user` user frames; a
    /// kernel row's (`kernel`) also its call site and kernel part, whose first frames the
    /// naming picks by what they are.
    pub fn prefix_key(&self, stack: u64, call_site: u64, user: usize, kernel: bool) -> Vec<u64> {
        let mut key = Vec::with_capacity(2 * user + 2);
        let Some(s) = self.stack(stack) else { return key };
        if kernel {
            key.push(call_site);
            key.extend(s.kernel());
            key.push(0);
        }
        for frame in s.user().take(user.saturating_add(self.wrapper_addresses(&s))) {
            match frame {
                FileFrame::Module { module, offset } => key.extend([u64::from(module) | 1 << 63, offset]),
                FileFrame::Address(a) => key.extend([1 << 62, a]),
            }
        }
        key
    }

    /// The frames of [`Self::frames`], with the names of the first `user` addresses of the
    /// user part only.
    fn named(&self, stack: u64, call_site: u64, user: usize) -> Vec<Frame> {
        let mut out = Vec::new();
        match self.stack(stack) {
            Some(s) => {
                let all_kernel: Vec<u64> = s.kernel().collect();
                let start = if call_site != 0 { all_kernel.iter().position(|&a| a == call_site) } else { None };
                let kernel = match start {
                    Some(i) => &all_kernel[i..],
                    None if call_site != 0 => {
                        out.extend(self.name(SymbolKey::Kernel(call_site)));
                        &all_kernel[..0]
                    }
                    None => &all_kernel[..],
                };
                let mut named: Vec<Vec<Frame>> = kernel.iter().map(|&a| self.name(SymbolKey::Kernel(a))).collect();
                // The probe itself and the tracepoint's call into it are not the kernel's
                // code: the stack starts after the last of them. (The program's own frame
                // comes first, and where the symbols hold no `bpf_prog_` names it takes
                // the name of whatever kernel symbol precedes the JIT image.)
                let lead = &named[..named.len().min(PROBE_FRAMES_MAX)];
                let probe = lead.iter().rposition(|chain| chain.iter().all(|f| is_probe_frame(&f.function)));
                named.drain(..probe.map_or(0, |i| i + 1));
                // No call site (page allocations): start at the page allocator's caller.
                if call_site == 0 {
                    let inside = named
                        .iter()
                        .take_while(|chain| chain.last().is_some_and(|f| is_page_allocator(&f.function)))
                        .count();
                    if inside < named.len() {
                        named.drain(..inside);
                    }
                }
                out.extend(named.into_iter().flatten());
                // `user` addresses past the allocation wrappers' (a site is named past
                // them, and its label shows the frames that follow).
                let wrappers = if user == usize::MAX { 0 } else { self.wrapper_addresses(&s) };
                for frame in s.user().take(user.saturating_add(wrappers)) {
                    out.extend(self.name(SymbolKey::User(frame)));
                }
            }
            None if call_site != 0 => out.extend(self.name(SymbolKey::Kernel(call_site))),
            None => {}
        }
        out
    }

    /// Whether the stack's walk was cut (depth limit, code without unwind information, or
    /// it left the code).
    pub fn is_truncated(&self, stack: u64) -> bool {
        self.stack(stack).is_some_and(|s| s.truncated)
    }

    /// The stack references (id + 1) of every stack with a Python frame.
    pub fn python_stacks(&self) -> HashSet<u64> {
        let python: HashSet<u32> =
            self.modules.values().filter(|m| crate::python::function_of(m).is_some()).map(|m| m.id).collect();
        if python.is_empty() {
            return HashSet::new();
        }
        self.stacks
            .iter()
            .filter(|s| s.user().any(|f| matches!(f, FileFrame::Module { module, .. } if python.contains(&module))))
            .map(|s| u64::from(s.id) + 1)
            .collect()
    }

    /// The stack references (id + 1, as events carry them) of every truncated stack.
    pub fn truncated_stacks(&self) -> HashSet<u64> {
        self.stacks.iter().filter(|s| s.truncated).map(|s| u64::from(s.id) + 1).collect()
    }
}

/// How deep in a kernel stack the probe's own frames may reach.
const PROBE_FRAMES_MAX: usize = 6;

/// Kernel frames of the probe that took the stack (a raw tracepoint runs its programs from
/// `bpf_trace_runN`).
fn is_probe_frame(function: &str) -> bool {
    ["bpf_prog_", "bpf_trace_run", "__bpf_trace_", "__traceiter_", "bpf_get_stack"]
        .iter()
        .any(|p| function.starts_with(p))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> StackTable {
        let mut stacks = BTreeMap::new();
        stacks.insert(
            0,
            FileStack {
                id: 0,
                pid: 1,
                kernel: vec![0xffff_0001, 0xffff_0002, 0xffff_0003],
                user: vec![FileFrame::Module { module: 0, offset: 0x10 }, FileFrame::Address(0x7f00)],
                truncated: false,
            },
        );
        let mut modules = BTreeMap::new();
        modules.insert(0, Module { id: 0, build_id: vec![], path: "/usr/bin/prog".into() });
        let symbols = vec![
            (SymbolKey::Kernel(0xffff_0002), vec![Symbol { name: "do_thing".into(), ..Default::default() }]),
            (
                SymbolKey::User(FileFrame::Module { module: 0, offset: 0x10 }),
                vec![
                    Symbol { name: "helper".into(), file: Some("/src/a.c".into()), line: 3, inlined: true },
                    Symbol { name: "main".into(), file: Some("/src/a.c".into()), line: 9, inlined: false },
                ],
            ),
        ];
        StackTable::new(stacks, modules, symbols)
    }

    #[test]
    fn stacks_with_the_same_frames_name_the_first_id() {
        let stack = |id: u32, pid: u32, offset: u64, truncated: bool| FileStack {
            id,
            pid,
            kernel: vec![],
            user: vec![FileFrame::Module { module: 0, offset }, FileFrame::Address(0x7f00)],
            truncated,
        };
        let stacks = [
            stack(3, 1, 0x10, false),
            stack(7, 1, 0x10, false), // as 3
            stack(8, 2, 0x10, false), // another process
            stack(9, 1, 0x20, false),
            stack(12, 1, 0x10, true),  // cut short
            stack(15, 1, 0x20, false), // as 9
            stack(20, 1, 0x10, false), // as 3
        ];
        let table = StackTable::new(stacks.into_iter().map(|s| (s.id, s)), BTreeMap::new(), []);
        let mut found: Vec<(u64, u64)> = table.duplicates().into_iter().collect();
        found.sort_unstable();
        assert_eq!(found, [(8, 4), (16, 10), (21, 4)]);
    }

    #[test]
    fn kernel_frames_start_at_the_call_site_and_inlines_expand() {
        let mut t = table();
        let frames = t.frames(1, 0xffff_0002);
        let names: Vec<String> = frames.iter().map(|f| f.function.to_string()).collect();
        assert_eq!(names, ["do_thing", "0xffff0003", "helper", "main", "[unknown] 0x7f00"]);
        assert!(frames[2].inlined && !frames[3].inlined);
        assert_eq!(frames[3].to_string(), "main (a.c:9)");
    }

    #[test]
    fn a_rows_key_frame_and_label_prefix_agree_with_the_whole_stack() {
        let mut t = table();
        // A Python frame (a module standing for a Python function) above the native ones.
        let build_id = crate::python::module_build_id("run", "/app/job.py");
        t.modules.insert(1, Module { id: 1, build_id, path: "/app/job.py".into() });
        if let Some(mut s) = t.stack(1).map(|s| s.to_file_stack()) {
            s.user.push(FileFrame::Module { module: 1, offset: 12 });
            t.insert_stack(s);
        }
        for call_site in [0, 0xffff_0002, 0xdead] {
            for stack in [0, 1, 7] {
                let whole = t.frames(stack, call_site);
                for domain in [Domain::User, Domain::Kernel] {
                    let key = t.key_frame(stack, call_site, domain, false);
                    assert_eq!(key.as_ref(), crate::grouping::first_frame(domain, &whole), "{stack} {call_site:x}");
                    let python = t.key_frame(stack, call_site, domain, true);
                    let expected = whole.iter().find(|f| f.python).or(crate::grouping::first_frame(domain, &whole));
                    assert_eq!(python.as_ref(), expected, "{stack} {call_site:x}");
                }
                for user in 0..4 {
                    let prefix = t.frames_prefix(stack, call_site, user);
                    assert!(whole.starts_with(&prefix), "{prefix:?} of {whole:?}");
                }
                assert_eq!(t.frames_once(stack, call_site), whole);
            }
        }
        // The Python frame is found without naming the native frames below it.
        let f = t.key_frame(1, 0, Domain::User, true).unwrap();
        assert!(f.python, "{f:?}");
    }

    /// A Rust allocation: two addresses of the standard library's plumbing (the second with
    /// a user function inlined around it), then the user's callers. The site is the first
    /// frame past the wrappers; prefixes name that many addresses past them; `none` names
    /// the allocator's caller.
    #[test]
    fn a_site_is_named_past_the_allocation_wrappers() {
        let at = |offset| FileFrame::Module { module: 0, offset };
        let sym = |name: &str, inlined| Symbol { name: name.into(), file: None, line: 0, inlined };
        let stack = |id, user: Vec<FileFrame>| FileStack { id, pid: 1, kernel: vec![], user, truncated: false };
        let mut modules = BTreeMap::new();
        modules.insert(0, Module { id: 0, build_id: vec![], path: "/usr/bin/prog".into() });
        let symbols = vec![
            (
                SymbolKey::User(at(0x10)),
                vec![sym("alloc::alloc::alloc", true), sym("alloc::raw_vec::finish_grow", false)],
            ),
            (
                SymbolKey::User(at(0x20)),
                vec![sym("alloc::raw_vec::RawVec<T>::grow_one", true), sym("prog::load", false)],
            ),
            (SymbolKey::User(at(0x30)), vec![sym("prog::main", false)]),
            (SymbolKey::User(at(0x40)), vec![sym("main", false)]),
            (SymbolKey::User(at(0x50)), vec![sym("prog::save", false)]),
        ];
        let stacks = [
            (0, stack(0, vec![at(0x10), at(0x20), at(0x30), at(0x40)])),
            (1, stack(1, vec![at(0x10), at(0x50), at(0x30), at(0x40)])),
            (2, stack(2, vec![at(0x10)])),
        ];
        let mut t = StackTable::new(stacks, modules, symbols);
        let key = |t: &StackTable, stack| t.key_frame(stack, 0, Domain::User, false).map(|f| f.function);
        assert_eq!(key(&t, 1).as_deref(), Some("prog::load"));
        assert_eq!(key(&t, 2).as_deref(), Some("prog::save"));
        // All wrappers: the first frame.
        assert_eq!(key(&t, 3).as_deref(), Some("alloc::alloc::alloc"));
        let names =
            |frames: Vec<Frame>| frames.into_iter().map(|f| (f.function.to_string(), f.wrapper)).collect::<Vec<_>>();
        assert_eq!(
            names(t.frames_prefix(1, 0, 2)),
            [
                ("alloc::alloc::alloc".to_string(), true),
                ("alloc::raw_vec::finish_grow".to_string(), true),
                ("alloc::raw_vec::RawVec<T>::grow_one".to_string(), true),
                ("prog::load".to_string(), false),
                ("prog::main".to_string(), false),
            ]
        );
        let whole = t.frames(1, 0);
        let label = crate::grouping::label(
            &crate::grouping::GroupKey::Site(Domain::User, "prog".into(), 0x20),
            &whole,
            &HashMap::new(),
        );
        assert_eq!(label, "prog::load ← prog::main ← main");
        // Two stacks part at their first address past the wrappers: their label keys differ
        // there, and include the wrapper's address.
        assert_eq!(t.prefix_key(1, 0, 1, false), [1 << 63, 0x10, 1 << 63, 0x20]);
        assert_ne!(t.prefix_key(1, 0, 1, false), t.prefix_key(2, 0, 1, false));

        // Deeper than any bound a stack could reach (a big std::map's copy recursed 33
        // addresses into the library): the key and the whole stack's first frame agree.
        let deep: Vec<FileFrame> = (0..100).map(|i| at(0x1000 + i)).chain([at(0x30), at(0x40)]).collect();
        t.insert_stack(stack(3, deep));
        t.extend_symbols(
            (0..100)
                .map(|i| (SymbolKey::User(at(0x1000 + i)), vec![sym("std::_Rb_tree<K>::_M_copy", false)]))
                .collect(),
        );
        assert_eq!(key(&t, 4).as_deref(), Some("prog::main"));
        let whole = t.frames(4, 0);
        assert_eq!(crate::grouping::first_frame(Domain::User, &whole).map(|f| &*f.function), Some("prog::main"));

        t.set_alloc_fns(crate::wrappers::AllocFns::none());
        assert_eq!(key(&t, 1).as_deref(), Some("alloc::alloc::alloc"));
        assert!(t.frames(1, 0).iter().all(|f| !f.wrapper));
        assert_eq!(t.prefix_key(1, 0, 1, false), [1 << 63, 0x10]);
        t.set_alloc_fns(crate::wrappers::AllocFns::from_args(&["prog::load".into()]));
        assert_eq!(key(&t, 1).as_deref(), Some("prog::main"));
        // An unnamed frame under a wrapper (its static helper without a symbol) is skipped
        // with it; one with no wrapper above it is the site.
        t.insert_stack(stack(5, vec![at(0x7777), at(0x20), at(0x30)]));
        t.insert_stack(stack(6, vec![at(0x7777), at(0x30)]));
        assert_eq!(key(&t, 6).as_deref(), Some("prog::main"));
        assert_eq!(key(&t, 7).as_deref(), Some("prog+0x7777"));
        for stack in [6, 7] {
            let whole = t.frames(stack, 0);
            assert_eq!(crate::grouping::first_frame(Domain::User, &whole).map(|f| f.function.clone()), key(&t, stack));
        }
    }

    #[test]
    fn unknown_user_frames_keep_their_module_and_offset() {
        let mut t = table();
        t.symbols.clear();
        let frames = t.frames(1, 0);
        assert_eq!(&*frames[3].function, "prog+0x10");
        assert!(frames[3].unknown);
    }

    #[test]
    fn the_probes_own_frames_are_left_out() {
        let mut t = table();
        t.symbols.insert(
            SymbolKey::Kernel(0xffff_0001),
            vec![Symbol { name: "bpf_prog_1234_kmalloc".into(), ..Default::default() }],
        );
        t.symbols
            .insert(SymbolKey::Kernel(0xffff_0003), vec![Symbol { name: "alloc_pages".into(), ..Default::default() }]);
        let names: Vec<String> = t.frames(1, 0).iter().map(|f| f.function.to_string()).collect();
        assert_eq!(&names[..2], ["do_thing", "alloc_pages"]);
    }

    #[test]
    fn a_misnamed_program_frame_before_the_tracepoint_is_left_out() {
        // Seen on a 6.18 kernel: the program's address named after the symbol before it.
        let mut t = table();
        t.symbols.insert(
            SymbolKey::Kernel(0xffff_0001),
            vec![Symbol { name: "__stop_runtime_ptr_USER_PTR_MAX".into(), ..Default::default() }],
        );
        t.symbols.insert(
            SymbolKey::Kernel(0xffff_0002),
            vec![Symbol { name: "bpf_trace_run4".into(), ..Default::default() }],
        );
        t.symbols
            .insert(SymbolKey::Kernel(0xffff_0003), vec![Symbol { name: "alloc_pages".into(), ..Default::default() }]);
        let names: Vec<String> = t.frames(1, 0).iter().map(|f| f.function.to_string()).collect();
        assert_eq!(names[0], "alloc_pages");
    }

    #[test]
    fn the_uprobe_machinery_is_told_by_its_functions() {
        for f in ["handle_swbp", "uprobe_write_opcode.isra.0", "install_breakpoint", "prepare_uretprobe"] {
            assert!(is_uprobe_machinery(f), "{f}");
        }
        for f in ["uprobe", "do_mmap", "handle_mm_fault", "uprobe_mmap_foo", ""] {
            assert!(!is_uprobe_machinery(f), "{f}");
        }
    }

    #[test]
    fn page_allocations_start_at_the_page_allocators_caller() {
        for f in ["__alloc_frozen_pages_noprof", "alloc_pages_mpol", "folio_alloc_mpol_noprof.isra.0", "__alloc_pages"]
        {
            assert!(is_page_allocator(f), "{f}");
        }
        for f in ["alloc_anon_folio", "alloc_pipe_info", "alloc_slab_page", "do_anonymous_page", "pte_alloc_one"] {
            assert!(!is_page_allocator(f), "{f}");
        }
        let mut t = table();
        let names = [(0xffff_0001u64, "__alloc_frozen_pages_noprof"), (0xffff_0002, "alloc_pages_mpol")];
        for (addr, name) in names {
            t.symbols.insert(SymbolKey::Kernel(addr), vec![Symbol { name: name.into(), ..Default::default() }]);
        }
        let frames: Vec<String> = t.frames(1, 0).iter().map(|f| f.function.to_string()).collect();
        assert_eq!(frames[0], "0xffff0003", "{frames:?}");
    }

    #[test]
    fn mmaps_from_inside_the_allocators_library_are_reserved() {
        let mut t = table();
        t.modules.insert(1, Module { id: 1, build_id: vec![], path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into() });
        t.insert_stack(FileStack {
            id: 1,
            pid: 1,
            kernel: vec![],
            user: vec![FileFrame::Module { module: 1, offset: 0x90 }, FileFrame::Module { module: 0, offset: 0x10 }],
            truncated: false,
        });
        assert!(!t.is_reserved_mmap(2), "no allocator known");
        t.set_allocator(Some("/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(t.is_reserved_mmap(2), "pthread_create's stack, from libc");
        assert!(!t.is_reserved_mmap(1), "the program's own mmap");
        assert_eq!(t.reserved_stacks(), HashSet::from([2]));
        // An allocator linked into the program: known functions only.
        t.set_allocator(Some("/usr/bin/prog"));
        assert!(!t.is_reserved_mmap(1));
        t.symbols.insert(
            SymbolKey::User(FileFrame::Module { module: 0, offset: 0x10 }),
            vec![Symbol { name: "allocate_stack".into(), ..Default::default() }],
        );
        t.cache.clear();
        assert!(t.is_reserved_mmap(1));
        // Another allocator's page mapping, whichever allocator the recording names.
        t.set_allocator(Some("/lib/x86_64-linux-gnu/libc.so.6"));
        for (name, reserved) in
            [("_rjem_je_pages_map", true), ("pages_map", true), ("mi_unix_mmap", true), ("map_pages_map", true)]
                .into_iter()
                .chain([("os_pages_map.constprop.0", true), ("je_pages_map.part.1", true), ("pages_map.cold", true)])
                .chain([("my_pages_mapper", false), ("pages_mapping", false), ("my_pages_mapper.constprop.0", false)])
        {
            t.symbols.insert(
                SymbolKey::User(FileFrame::Module { module: 0, offset: 0x10 }),
                vec![Symbol { name: name.into(), ..Default::default() }],
            );
            assert_eq!(t.is_reserved_mmap(1), reserved, "{name}");
        }
    }

    #[test]
    fn a_missing_stack_falls_back_to_the_call_site() {
        let mut t = table();
        let frames = t.frames(99, 0xffff_0002);
        assert_eq!(frames.len(), 1);
        assert_eq!(&*frames[0].function, "do_thing");
        assert!(t.frames(0, 0).is_empty());
    }
}
