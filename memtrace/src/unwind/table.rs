//! A file's unwind table as the probes read it: 8-byte rows sorted by pc (relative to a
//! base), a page index that narrows a lookup to the rows of one 4 KiB page of code, and the
//! file's segments. Built once per file from its call-frame information ([`cfi`]), shared
//! by every process that maps the file, kept in the disk cache, and looked up here with
//! the same search the probes run (`memtrace_common::unwind::find_row`).
//!
//! [`cfi`]: super::cfi
use std::sync::Arc;

use memtrace_common::{
    UnwindRule,
    unwind::{encode_row, find_row, row_pc, row_rule, table},
};

use super::cfi::{Row, Segment};

#[derive(Debug, Clone)]
pub struct Table {
    /// The file virtual address row pcs are relative to.
    pub pc_base: u64,
    /// Where the file's loadable segments sit (to turn a mapping's file offset into the
    /// file's virtual addresses).
    pub segments: Vec<Segment>,
    body: Body,
}

/// Where a table's page index and rows are: built here, read in place from a disk-cache
/// entry mapped into memory, or read from the probes' own copy. Tables are kept after
/// their install only to finish stack copies, whose lookups touch a few pages: a PyTorch
/// program's 176 tables read into the heap held 92 MB through its whole recording; mapped,
/// their pages are the page cache's (clean, reclaimable), and those the checksum and the
/// install read are handed back ([`Table::drop_resident`]); a lookup's stay mapped until
/// the end. Without a cache, a table built here is read from its BPF map once installed
/// ([`Table::in_probes_map`]): the kernel holds those pages anyway.
#[derive(Debug, Clone)]
enum Body {
    /// Per 4 KiB page from `pc_base`, the index of the row in effect at its start (one more
    /// entry for the end); the encoded rows (`memtrace_common::unwind::encode_row`).
    Owned { pages: Vec<u32>, rows: Vec<u64> },
    /// The same, little-endian, at these offsets of a mapping (bounds checked when the
    /// table was made: [`Table::mapped`]; a probes' array holds the table it was filled
    /// with, its header checked by [`Table::in_probes_map`]), each page entry `page_bytes`
    /// wide (4 in a cache entry, 8 in the probes' array, the entry in its low half).
    Mapped { view: View, pages_at: usize, n_pages: usize, page_bytes: usize, rows_at: usize, n_rows: usize },
}

/// A mapping a table is read from.
#[derive(Debug, Clone)]
enum View {
    /// A file (a cache entry): its pages may be handed back, and read again.
    File(Arc<memmap2::Mmap>),
    /// The probes' array.
    Probes(Arc<ProbesView>),
}

impl View {
    /// The mapping (None if the probes' array could not be mapped).
    fn map(&self) -> Option<Arc<memmap2::Mmap>> {
        match self {
            View::File(map) => Some(Arc::clone(map)),
            View::Probes(view) => view.map(),
        }
    }
}

/// A table's BPF array, mapped read-only while lookups use it. The kernel inserts every
/// page of the array when it is mapped, and a page handed back could not be faulted in
/// again (the mapping has no fault handler: SIGBUS), so a mapping left in place would
/// hold the whole table in memtrace's resident set: it is unmapped once unused for a
/// while ([`Table::release_if_idle`]) and mapped again when a lookup needs it.
#[derive(Debug)]
pub struct ProbesView {
    fd: std::os::fd::OwnedFd,
    len: usize,
    /// The mapping while in use, and when a lookup last used it.
    state: std::sync::Mutex<(Option<Arc<memmap2::Mmap>>, std::time::Instant)>,
}

impl ProbesView {
    fn map(&self) -> Option<Arc<memmap2::Mmap>> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.1 = std::time::Instant::now();
        if state.0.is_none() {
            match map_array(&self.fd, self.len) {
                Ok(map) => {
                    log::trace!("mapped a table's array of the probes ({} bytes)", self.len);
                    state.0 = Some(Arc::new(map));
                }
                Err(e) => log::debug!("mapping an unwind table's array: {e}"),
            }
        }
        state.0.clone()
    }

    fn release_if_idle(&self, idle: std::time::Duration) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.1.elapsed() >= idle {
            state.0 = None;
        }
    }
}

/// The first `len` bytes of a table's BPF array (`fd`), mapped read-only.
fn map_array(fd: &std::os::fd::OwnedFd, len: usize) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: a shared read-only mapping of an mmapable BPF array holding a table (`len`
    // is within its size, rounded up to pages); nothing writes a table's array once it is
    // filled (the probes only read it, and userspace fills each array once, before
    // installing it).
    unsafe { memmap2::MmapOptions::new().len(len).map(fd) }
}

/// Code a table covers at most from its base (pcs are 32 bits).
const MAX_SPAN: u64 = 1 << 32;

fn u32_le(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn u64_le(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

impl Table {
    /// A table of owned parts.
    pub fn new(pc_base: u64, pages: Vec<u32>, rows: Vec<u64>, segments: Vec<Segment>) -> Self {
        Self { pc_base, segments, body: Body::Owned { pages, rows } }
    }

    /// A table whose `n_pages` page-index entries start at byte `pages_at` of `map` and its
    /// `n_rows` rows at `rows_at`; None if they do not lie inside it.
    pub fn mapped(
        pc_base: u64,
        segments: Vec<Segment>,
        map: Arc<memmap2::Mmap>,
        (pages_at, n_pages): (usize, usize),
        (rows_at, n_rows): (usize, usize),
    ) -> Option<Self> {
        let fits =
            |at: usize, n: usize, size: usize| n.checked_mul(size)?.checked_add(at).filter(|&end| end <= map.len());
        fits(pages_at, n_pages, 4)?;
        fits(rows_at, n_rows, 8)?;
        let body = Body::Mapped { view: View::File(map), pages_at, n_pages, page_bytes: 4, rows_at, n_rows };
        Some(Self { pc_base, segments, body })
    }

    /// This table, read from the probes' array it was installed in (`fd`, laid out as
    /// [`Table::elements`]), mapped only while lookups use it; None if the array cannot be
    /// mapped or does not hold it.
    pub fn in_probes_map(&self, fd: std::os::fd::OwnedFd) -> Option<Self> {
        let (n_pages, n_rows) = (self.page_entries(), self.row_count());
        // The header checked through its first page only (mapping the whole array would
        // put all of it in the resident set beside this copy).
        let head = map_array(&fd, 4096).ok()?;
        let element = |i: usize| head.get(8 * i..8 * i + 8).map(u64_le);
        if element(table::PC_BASE as usize) != Some(self.pc_base)
            || element(table::COUNTS as usize) != Some(table::counts(self.page_count(), n_rows as u32))
        {
            return None;
        }
        drop(head);
        let len = self.byte_size().div_ceil(4096) * 4096;
        let view = ProbesView { fd, len, state: std::sync::Mutex::new((None, std::time::Instant::now())) };
        let pages_at = 8 * table::PAGES as usize;
        let rows_at = pages_at + 8 * n_pages;
        let view = View::Probes(Arc::new(view));
        let body = Body::Mapped { view, pages_at, n_pages, page_bytes: 8, rows_at, n_rows };
        Some(Self { pc_base: self.pc_base, segments: self.segments.clone(), body })
    }

    /// Unmaps the probes' array this table is read from if no lookup used it for `idle`.
    pub fn release_if_idle(&self, idle: std::time::Duration) {
        if let Body::Mapped { view: View::Probes(view), .. } = &self.body {
            view.release_if_idle(idle);
        }
    }

    /// Whether the probes' array this table is read from is mapped now (None: not read
    /// from one).
    #[cfg(test)]
    pub fn probes_view_mapped(&self) -> Option<bool> {
        match &self.body {
            Body::Mapped { view: View::Probes(view), .. } => Some(view.state.lock().unwrap().0.is_some()),
            _ => None,
        }
    }

    /// Whether the table is read from the probes' array.
    pub fn in_probes(&self) -> bool {
        matches!(self.body, Body::Mapped { view: View::Probes(_), .. })
    }

    /// Packs sorted, merged rows.
    pub fn from_rows(rows: &[Row], segments: Vec<Segment>) -> Self {
        let Some(first) = rows.first() else {
            return Self::new(0, vec![0], Vec::new(), segments);
        };
        let pc_base = first.pc;
        let packed =
            rows.iter().take_while(|r| r.pc - pc_base < MAX_SPAN).map(|r| encode_row((r.pc - pc_base) as u32, r.rule));
        Self::from_packed(pc_base, packed.collect(), segments)
    }

    /// The table of encoded rows (`memtrace_common::unwind::encode_row`), sorted, their pcs
    /// relative to `pc_base`: the page index is built for them.
    pub fn from_packed(pc_base: u64, rows: Vec<u64>, segments: Vec<Segment>) -> Self {
        // The last row ends the covered code (the frame-pointer rule, as `Cfi::table` ends
        // every FDE): the index spans up to it.
        let span = rows.last().map_or(0, |&r| u64::from(row_pc(r))) + 1;
        let n_pages = span.div_ceil(1 << table::PAGE_SHIFT) as usize;
        let mut pages = Vec::with_capacity(n_pages + 1);
        let mut row = 0usize;
        for page in 0..=n_pages {
            let start = (page as u64) << table::PAGE_SHIFT;
            while row + 1 < rows.len() && u64::from(row_pc(rows[row + 1])) <= start {
                row += 1;
            }
            pages.push(row as u32);
        }
        Self::new(pc_base, pages, rows, segments)
    }

    /// Entries of the page index (one per page, one more for the end).
    pub fn page_entries(&self) -> usize {
        match &self.body {
            Body::Owned { pages, .. } => pages.len(),
            Body::Mapped { n_pages, .. } => *n_pages,
        }
    }

    pub fn row_count(&self) -> usize {
        match &self.body {
            Body::Owned { rows, .. } => rows.len(),
            Body::Mapped { n_rows, .. } => *n_rows,
        }
    }

    pub fn page_count(&self) -> u32 {
        self.page_entries().saturating_sub(1) as u32
    }

    /// Entry `i` of the page index; `bytes`, the mapping of a mapped table.
    fn page(&self, bytes: Option<&[u8]>, i: usize) -> Option<u32> {
        match (&self.body, bytes) {
            (Body::Owned { pages, .. }, _) => pages.get(i).copied(),
            (Body::Mapped { pages_at, n_pages, page_bytes, .. }, Some(b)) if i < *n_pages => {
                Some(u32_le(&b[pages_at + page_bytes * i..pages_at + page_bytes * i + 4]))
            }
            _ => None,
        }
    }

    /// Row `i`; `bytes`, the mapping of a mapped table.
    fn row(&self, bytes: Option<&[u8]>, i: usize) -> Option<u64> {
        match (&self.body, bytes) {
            (Body::Owned { rows, .. }, _) => rows.get(i).copied(),
            (Body::Mapped { rows_at, n_rows, .. }, Some(b)) if i < *n_rows => {
                Some(u64_le(&b[rows_at + 8 * i..rows_at + 8 * i + 8]))
            }
            _ => None,
        }
    }

    /// The page index, in order.
    pub fn pages(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match &self.body {
            Body::Owned { pages, .. } => Box::new(pages.iter().copied()),
            Body::Mapped { view, pages_at, n_pages, page_bytes, .. } => {
                let (Some(map), at, step) = (view.map(), *pages_at, *page_bytes) else {
                    return Box::new(std::iter::empty());
                };
                Box::new((0..*n_pages).map(move |i| u32_le(&map[at + step * i..at + step * i + 4])))
            }
        }
    }

    /// The encoded rows, in order.
    pub fn rows(&self) -> Box<dyn Iterator<Item = u64> + '_> {
        match &self.body {
            Body::Owned { rows, .. } => Box::new(rows.iter().copied()),
            Body::Mapped { view, rows_at, n_rows, .. } => {
                let (Some(map), at) = (view.map(), *rows_at) else { return Box::new(std::iter::empty()) };
                Box::new((0..*n_rows).map(move |i| u64_le(&map[at + 8 * i..at + 8 * i + 8])))
            }
        }
    }

    /// The rows as their pcs (file virtual addresses) and rules.
    pub fn decoded_rows(&self) -> Vec<Row> {
        self.rows().map(|r| Row { pc: self.pc_base + u64::from(row_pc(r)), rule: row_rule(r) }).collect()
    }

    /// Whether the rows are read in place from a mapping (a cache entry, the probes' array).
    pub fn is_mapped(&self) -> bool {
        matches!(self.body, Body::Mapped { .. })
    }

    /// Lets the kernel take back the mapped file's pages read so far (its checksum, the
    /// install): they stay in the page cache, out of memtrace's resident set, and a later
    /// lookup reads them again. Nothing for a table built here or read from the probes'.
    pub fn drop_resident(&self) {
        if let Body::Mapped { view: View::File(map), .. } = &self.body {
            crate::elf::forget_resident(map);
        }
    }

    /// The table as the probes' array holds it (`memtrace_common::unwind::table`), in order.
    pub fn element_iter(&self) -> impl Iterator<Item = u64> + '_ {
        [self.pc_base, table::counts(self.page_count(), self.row_count() as u32)]
            .into_iter()
            .chain(self.pages().map(u64::from))
            .chain(self.rows())
    }

    /// The elements, collected.
    pub fn elements(&self) -> Vec<u64> {
        self.element_iter().collect()
    }

    pub fn element_count(&self) -> usize {
        2 + self.page_entries() + self.row_count()
    }

    /// Bytes the table takes in the probes' array.
    pub fn byte_size(&self) -> usize {
        self.element_count() * 8
    }

    /// The rule for file virtual address `vaddr`, found as the probes find it; the
    /// frame-pointer rule outside the covered code.
    pub fn rule_at(&self, vaddr: u64) -> UnwindRule {
        let Some(rel) = vaddr.checked_sub(self.pc_base) else { return UnwindRule::FRAME_POINTER };
        let page = rel >> table::PAGE_SHIFT;
        if page >= u64::from(self.page_count()) {
            return UnwindRule::FRAME_POINTER;
        }
        // (A mapped table's mapping, taken once for the lookup.)
        let map = match &self.body {
            Body::Owned { .. } => None,
            Body::Mapped { view, .. } => match view.map() {
                Some(map) => Some(map),
                None => return UnwindRule::FRAME_POINTER,
            },
        };
        let bytes = map.as_deref().map(|m| &m[..]);
        let (Some(lo), Some(hi)) = (self.page(bytes, page as usize), self.page(bytes, page as usize + 1)) else {
            return UnwindRule::FRAME_POINTER;
        };
        find_row(lo, hi, rel as u32, |i| self.row(bytes, i as usize)).map_or(UnwindRule::FRAME_POINTER, row_rule)
    }

    /// The file virtual address of a file offset (in a loadable segment).
    pub fn vaddr_of_file_offset(&self, offset: u64) -> Option<u64> {
        super::cfi::vaddr_of_file_offset(&self.segments, offset)
    }
}

/// Equal tables hold the same rows, wherever they are kept.
impl PartialEq for Table {
    fn eq(&self, other: &Self) -> bool {
        self.pc_base == other.pc_base
            && self.segments == other.segments
            && self.pages().eq(other.pages())
            && self.rows().eq(other.rows())
    }
}

impl Eq for Table {}

#[cfg(test)]
mod tests {
    use memtrace_common::unwind::kind;
    use proptest::prelude::*;

    use super::*;
    use crate::unwind::cfi::Cfi;

    fn rule(cfa: i32) -> UnwindRule {
        UnwindRule { cfa_offset: cfa, rbp_offset: 0, kind: kind::CFA_SP, _pad: 0 }
    }

    /// The rule in effect at `vaddr` by a plain scan of the rows.
    fn scan(rows: &[Row], vaddr: u64) -> UnwindRule {
        rows.iter().rev().find(|r| r.pc <= vaddr).map_or(UnwindRule::FRAME_POINTER, |r| r.rule)
    }

    #[test]
    fn lookups_agree_with_a_scan_of_the_rows() {
        let rows = vec![
            Row { pc: 0x1000, rule: rule(8) },
            Row { pc: 0x1004, rule: rule(16) },
            Row { pc: 0x2ff0, rule: rule(24) },
            Row { pc: 0x3000, rule: UnwindRule::STOP },
            Row { pc: 0x5000, rule: rule(8) },
            Row { pc: 0x5010, rule: UnwindRule::FRAME_POINTER },
        ];
        let t = Table::from_rows(&rows, vec![]);
        assert_eq!(t.pc_base, 0x1000);
        assert_eq!(t.page_count(), 5);
        for vaddr in 0xf00..0x5100 {
            assert_eq!(t.rule_at(vaddr), scan(&rows, vaddr), "{vaddr:#x}");
        }
        let elements = t.elements();
        assert_eq!(elements[0], 0x1000);
        assert_eq!(elements[1], table::counts(5, 6));
        assert_eq!(elements.len() * 8, t.byte_size());
    }

    proptest! {
        #[test]
        fn random_tables_agree_with_a_scan(gaps in proptest::collection::vec(1u64..6000, 1..60), probes in proptest::collection::vec(0u64..200_000, 50)) {
            let mut pc = 0x40_0000u64;
            let mut rows: Vec<Row> = gaps.iter().enumerate().map(|(i, g)| {
                pc += g;
                Row { pc, rule: if i % 3 == 2 { UnwindRule::STOP } else { rule(8 * (i as i32 + 1)) } }
            }).collect();
            // Tables end as every FDE does: code past it is walked by its frame pointer.
            rows.push(Row { pc: pc + 1, rule: UnwindRule::FRAME_POINTER });
            let t = Table::from_rows(&rows, vec![]);
            for p in probes {
                let vaddr = 0x40_0000 + p;
                prop_assert_eq!(t.rule_at(vaddr), scan(&rows, vaddr));
            }
        }
    }

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    /// The test binary's own table gives every row's rule at every row's pc and in between.
    #[test]
    fn a_real_binary_table_answers_like_its_rows() {
        let maps = crate::procfs::Maps::read_self().unwrap();
        let m = maps.find(marker()).unwrap();
        let cfi = Cfi::open(&m.path).unwrap();
        let t = cfi.table().unwrap();
        let rows = t.decoded_rows();
        for w in rows.windows(2).step_by(7).take(20_000) {
            assert_eq!(t.rule_at(w[0].pc), w[0].rule);
            assert_eq!(t.rule_at(w[1].pc - 1), w[0].rule);
        }
        let vaddr = t.vaddr_of_file_offset(m.file_offset(marker())).unwrap();
        assert_eq!(t.rule_at(vaddr).cfa_offset, 8);
    }
}
