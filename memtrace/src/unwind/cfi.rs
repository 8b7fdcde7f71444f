//! Reading a file's call-frame information — `.eh_frame`, and `.debug_frame` for code it
//! does not cover — into its unwind table ([`Table`]): for every FDE, each row of its CFA
//! program turned into the [`UnwindRule`] the probes can follow (or a stop), plus the
//! frame-pointer rule where no FDE covers the code; the rows packed (8 bytes) as they are
//! read, sorted and merged in place. Also where the file's loadable segments sit, so a
//! mapping's file offset can be turned into the file's virtual addresses.
use std::{borrow::Cow, fs::File, ops::Range, path::Path};

use anyhow::{Context as _, Result};
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice, Reader, Register, RegisterRule, RunTimeEndian,
    Section as _, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};
use memmap2::Mmap;
use memtrace_common::{
    UnwindRule,
    unwind::{encode_row, encode_rule, kind, row_pc},
};
use object::{Object as _, ObjectSection as _, ObjectSegment as _};

use super::table::Table;

/// The parts of a row of the unwind table the probes can follow, as found in the CFI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cfa {
    Sp(i64),
    Bp(i64),
    /// `DW_OP_breg6 N; DW_OP_deref`: a realigned frame's CFA saved below rbp.
    BpDeref(i64),
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// Not mentioned, or same value: the register is unchanged in the caller.
    Unchanged,
    /// Saved at CFA + N.
    At(i64),
    /// The caller has no value (the return address of the outermost frame).
    Undefined,
    /// In %rdi (the return address of glibc's `vfork` during its syscall).
    InRdi,
    /// Anything else (another register, an expression).
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSummary {
    pub signal_frame: bool,
    pub cfa: Cfa,
    pub ra: Saved,
    pub rbp: Saved,
}

/// The rule the probes can walk for a row; [`kind::STOP`] for what they cannot.
pub fn rule_for(row: RowSummary) -> UnwindRule {
    if row.signal_frame {
        return UnwindRule::SIGNAL;
    }
    match (row.ra, row.cfa, row.rbp) {
        (Saved::Undefined, ..) => return UnwindRule::OUTERMOST,
        (Saved::At(-8), ..) => {}
        (Saved::InRdi, Cfa::Sp(o), Saved::Unchanged) => {
            return i32::try_from(o).map_or(UnwindRule::STOP, |cfa_offset| UnwindRule {
                cfa_offset,
                rbp_offset: 0,
                kind: kind::RA_RDI,
                _pad: 0,
            });
        }
        _ => return UnwindRule::STOP,
    }
    let (kind, offset) = match row.cfa {
        Cfa::Sp(o) => (kind::CFA_SP, o),
        Cfa::Bp(o) => (kind::CFA_BP, o),
        Cfa::BpDeref(o) => (kind::CFA_BP_DEREF, o),
        Cfa::Other => return UnwindRule::STOP,
    };
    let Ok(cfa_offset) = i32::try_from(offset) else { return UnwindRule::STOP };
    let rbp_offset = match row.rbp {
        Saved::Unchanged => 0,
        Saved::At(o) => match i16::try_from(o) {
            Ok(o) if o != 0 => o,
            _ => return UnwindRule::STOP,
        },
        Saved::Undefined | Saved::InRdi | Saved::Other => return UnwindRule::STOP,
    };
    UnwindRule { cfa_offset, rbp_offset, kind, _pad: 0 }
}

/// Where a loadable segment sits: file offset → virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub file_offset: u64,
    pub vaddr: u64,
    pub file_size: u64,
    /// `PF_X`: the segment holds code.
    pub executable: bool,
}

/// The loadable segments of a parsed ELF file.
pub fn segments_of(elf: &object::File<'_>) -> Vec<Segment> {
    use object::read::elf::ProgramHeader as _;
    let flags_of = |index: usize| -> bool {
        match elf {
            object::File::Elf64(f) => f
                .elf_program_headers()
                .iter()
                .filter(|ph| ph.p_type(f.endian()) == object::elf::PT_LOAD)
                .nth(index)
                .is_some_and(|ph| ph.p_flags(f.endian()) & object::elf::PF_X != 0),
            _ => false,
        }
    };
    elf.segments()
        .enumerate()
        .map(|(i, s)| {
            let (file_offset, file_size) = s.file_range();
            Segment { file_offset, vaddr: s.address(), file_size, executable: flags_of(i) }
        })
        .collect()
}

/// The virtual address (as in the ELF file) of a file offset in a loadable segment. The
/// offset may lie in the page the segment starts in (mappings start at page boundaries, a
/// segment need not); where two segments share that page, the executable one is meant.
pub fn vaddr_of_file_offset(segments: &[Segment], offset: u64) -> Option<u64> {
    let holds =
        |s: &&Segment| s.file_size > 0 && (s.file_offset & !0xfff..s.file_offset + s.file_size).contains(&offset);
    segments
        .iter()
        .filter(holds)
        .max_by_key(|s| (s.executable, s.file_offset))
        .map(|s| (offset + s.vaddr).wrapping_sub(s.file_offset))
}

/// Code this far past the ELF entry point, without call-frame information, is the entry
/// code (ld.so's `_start` has none): the outermost frame.
const ENTRY_CODE_BYTES: u64 = 64;

/// The C runtime's start functions, between the entry point and `main` (and the
/// constructors): where no call-frame information describes them, they are the outermost
/// frame. musl builds its C code without unwind tables, so every stack of a program linked
/// statically with it (a Rust or C program built for `*-linux-musl`, Alpine's) otherwise
/// stopped in `libc_start_main_stage2` marked cut short. glibc's have call-frame
/// information and keep theirs.
const START_FUNCTIONS: [&str; 5] =
    ["_start", "_start_c", "__libc_start_main", "libc_start_main_stage2", "__libc_start_init"];

/// The address ranges of the [`START_FUNCTIONS`] a file's symbol tables define.
fn start_functions(elf: &object::File<'_>) -> Vec<(u64, u64)> {
    use object::ObjectSymbol as _;
    let mut found: Vec<(u64, u64)> = elf
        .symbols()
        .chain(elf.dynamic_symbols())
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0 && s.address() != 0)
        .filter(|s| s.name_bytes().is_ok_and(|n| START_FUNCTIONS.iter().any(|f| f.as_bytes() == n)))
        .map(|s| (s.address(), s.address().saturating_add(s.size())))
        .collect();
    found.sort_unstable();
    found.dedup();
    found
}

/// A row of a file's table before packing: from `pc` (a virtual address of the file) on,
/// `rule` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub pc: u64,
    pub rule: UnwindRule,
}

/// The bytes of a parsed file: mapped, or (`Cfi::parse`) copied.
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Owned(v) => v,
        }
    }
}

/// Where a CFI section's bytes are: read in place from the file's bytes, or (a compressed
/// `.debug_frame`) decompressed here.
enum SectionBytes {
    InFile(Range<usize>),
    Decompressed(Vec<u8>),
}

/// A file's call-frame information and segments. The sections are read in place from the
/// file's mapping: copied, libtorch_cpu's 17.8 MB `.eh_frame` was in memory twice while
/// its table was built (the mapping's pages and the copy).
pub struct Cfi {
    pub segments: Vec<Segment>,
    entry: u64,
    /// The C runtime's start functions the file defines ([`START_FUNCTIONS`]).
    start_code: Vec<(u64, u64)>,
    data: Bytes,
    endian: RunTimeEndian,
    eh_frame: Option<SectionBytes>,
    debug_frame: Option<SectionBytes>,
    bases: BaseAddresses,
}

impl Cfi {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: read-only private mapping for the time the file is parsed; a concurrent
        // truncation could fault, the risk every ELF reader (ld.so too) takes.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        Self::read(Bytes::Mapped(map))
            .with_context(|| format!("reading the call-frame information of {}", path.display()))
    }

    pub fn parse(data: &[u8]) -> Result<Self> {
        Self::read(Bytes::Owned(data.to_vec()))
    }

    fn read(data: Bytes) -> Result<Self> {
        let elf = object::File::parse(&*data).context("not an ELF file")?;
        let endian = if elf.is_little_endian() { RunTimeEndian::Little } else { RunTimeEndian::Big };
        let segments = segments_of(&elf);
        let mut bases = BaseAddresses::default();
        if let Some(text) = elf.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = elf.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        if let Some(hdr) = elf.section_by_name(".eh_frame_hdr") {
            bases = bases.set_eh_frame_hdr(hdr.address());
        }
        let section_bytes = |name: &str| {
            let section = elf.section_by_name(name)?;
            Some((
                section.address(),
                match section.uncompressed_data().ok()? {
                    // (A slice of `data`: its place in it. An empty or NOBITS section is a
                    // slice of nothing, anywhere: none.)
                    Cow::Borrowed(b) => {
                        let at = (b.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
                        if b.is_empty() || at.checked_add(b.len())? > data.len() {
                            return None;
                        }
                        SectionBytes::InFile(at..at + b.len())
                    }
                    Cow::Owned(v) => SectionBytes::Decompressed(v),
                },
            ))
        };
        let eh_frame = section_bytes(".eh_frame").map(|(address, bytes)| {
            bases = bases.clone().set_eh_frame(address);
            bytes
        });
        let debug_frame = section_bytes(".debug_frame").map(|(_, bytes)| bytes);
        let entry = elf.entry();
        let start_code = start_functions(&elf);
        drop(elf);
        Ok(Self { segments, entry, start_code, data, endian, eh_frame, debug_frame, bases })
    }

    fn section<'a>(&'a self, bytes: &'a Option<SectionBytes>) -> Option<EndianSlice<'a, RunTimeEndian>> {
        let slice = match bytes.as_ref()? {
            SectionBytes::InFile(range) => self.data.get(range.clone())?,
            SectionBytes::Decompressed(v) => v,
        };
        Some(EndianSlice::new(slice, self.endian))
    }

    /// The file's unwind table (None if its call-frame information has no row): the FDEs'
    /// rows, the frame-pointer rule where no FDE covers code
    /// ([`UnwindRule::FRAME_POINTER`]), and the entry code and the C runtime's start
    /// functions as the outermost frame when no FDE describes them; sorted, without two consecutive rows of the same rule. Parsing
    /// stops at the first malformed entry of a section; what came before is kept.
    pub fn table(&self) -> Option<Table> {
        let eh_frame = self.section(&self.eh_frame).map(|s| {
            let mut frame = EhFrame::from(s);
            frame.set_address_size(8);
            frame
        });
        let debug_frame = self.section(&self.debug_frame).map(|s| {
            let mut frame = DebugFrame::from(s);
            frame.set_address_size(8);
            frame
        });
        // Row pcs are kept relative to a base from the start, 8 bytes a row: the lowest
        // address any FDE (or the entry, or a start function) starts at, raised to the first row's after merging.
        let base = [
            eh_frame.as_ref().and_then(|s| lowest_start(s, &self.bases)),
            debug_frame.as_ref().and_then(|s| lowest_start(s, &self.bases)),
            (self.entry != 0).then_some(self.entry),
            self.start_code.first().map(|&(start, _)| start),
        ]
        .into_iter()
        .flatten()
        .min()?;
        // Every FDE row and FDE end, sorted and merged in place: a big library has
        // millions (libtriton 2.35 M after merging). Room for a row per two bytes of CFI
        // is reserved (more than they take: untouched room costs no memory), so that the
        // vector does not move as it grows.
        let cfi_bytes =
            eh_frame.as_ref().map_or(0, |s| s.reader().len()) + debug_frame.as_ref().map_or(0, |s| s.reader().len());
        // (Asked for, not required: with strict overcommit or a limit on address space
        // the room may be refused, and the vector grows as it must.)
        let mut rows: Vec<u64> = Vec::new();
        let _ = rows.try_reserve((cfi_bytes / 2 + 2).min(MAX_RESERVED_ROWS));
        let mut ctx = Box::new(UnwindContext::new());
        let mut covered: Vec<(u64, u64)> = Vec::new();
        let mut out = Rows { base, rows: &mut rows };
        if let Some(eh) = &eh_frame {
            fde_rows(eh, &self.bases, &mut ctx, &[], &mut out, &mut covered);
        }
        if let Some(debug) = &debug_frame {
            covered.sort_unstable();
            let eh_spans = std::mem::take(&mut covered);
            fde_rows(debug, &self.bases, &mut ctx, &eh_spans, &mut out, &mut covered);
            covered.extend(eh_spans);
        }
        let entry = (self.entry != 0).then_some((self.entry, self.entry.saturating_add(ENTRY_CODE_BYTES)));
        for (start, end) in entry.into_iter().chain(self.start_code.iter().copied()) {
            if !covered.iter().any(|&(s, e)| (s..e).contains(&start)) {
                out.push(start, encode_rule(UnwindRule::OUTERMOST));
                out.push(end, FDE_END);
            }
        }
        let first = merge(&mut rows)?;
        Some(Table::from_packed(base + u64::from(first), rows, self.segments.clone()))
    }
}

impl Cfi {
    /// The code each FDE of the file describes, as (start, end) virtual addresses, sorted:
    /// where no symbol names it, a function is known by where its FDE starts (GCC and clang
    /// give every function its own, and a cold part its own). `.debug_frame`'s FDEs fill in
    /// code `.eh_frame` does not describe.
    pub fn functions(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        if let Some(s) = self.section(&self.eh_frame) {
            let mut frame = EhFrame::from(s);
            frame.set_address_size(8);
            fde_spans(&frame, &self.bases, &mut out);
        }
        let from_eh = out.len();
        if let Some(s) = self.section(&self.debug_frame) {
            let mut frame = DebugFrame::from(s);
            frame.set_address_size(8);
            let mut more = Vec::new();
            fde_spans(&frame, &self.bases, &mut more);
            out[..from_eh].sort_unstable();
            let eh = &out[..from_eh];
            let new: Vec<(u64, u64)> = more.into_iter().filter(|&(start, end)| !overlaps(eh, start, end)).collect();
            out.extend(new);
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The file offset where the function holding file offset `offset` starts (the start of
    /// the FDE that covers it), if an FDE does; `functions` is [`Cfi::functions`].
    pub fn function_start(&self, functions: &[(u64, u64)], offset: u64) -> Option<u64> {
        let vaddr = vaddr_of_file_offset(&self.segments, offset)?;
        let i = functions.partition_point(|&(s, _)| s <= vaddr).checked_sub(1)?;
        let (start, end) = functions[i];
        if vaddr >= end {
            return None;
        }
        // Back to a file offset, through the segment that holds both.
        self.segments
            .iter()
            .filter(|s| s.file_size > 0 && (s.vaddr..s.vaddr + s.file_size).contains(&start))
            .max_by_key(|s| s.executable)
            .map(|s| start - s.vaddr + s.file_offset)
    }
}

/// Whether code from `start` to `end` overlaps one of `spans` (sorted FDE spans of another
/// section; the few that start last before `end` are looked at).
fn overlaps(spans: &[(u64, u64)], start: u64, end: u64) -> bool {
    let at = spans.partition_point(|&(s, _)| s < end);
    spans[..at].iter().rev().take(4).any(|&(s, e)| s < end && start < e)
}

/// Appends the span of every well-formed FDE of `section`.
fn fde_spans<R: Reader<Offset = usize>, S: UnwindSection<R>>(
    section: &S,
    bases: &BaseAddresses,
    out: &mut Vec<(u64, u64)>,
) {
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(S::cie_from_offset) else { continue };
        if fde.initial_address() < fde.end_address() {
            out.push((fde.initial_address(), fde.end_address()));
        }
    }
}

/// Rows reserved at most ahead of reading the CFI (256 MiB of room).
const MAX_RESERVED_ROWS: usize = 1 << 25;

/// The rule bits of the row an FDE's end leaves: no rule encodes to 0 (kinds start at 1),
/// so at one pc it sorts before, and loses to, the row of an FDE that starts there. Merged,
/// it is the frame-pointer rule: code up to the next FDE that none describes.
const FDE_END: u32 = 0;

/// Rows being collected, their pcs relative to `base`; a pc outside the 4 GiB a table
/// spans from it is left out.
struct Rows<'a> {
    base: u64,
    rows: &'a mut Vec<u64>,
}

impl Rows<'_> {
    fn push(&mut self, pc: u64, rule: u32) {
        let Some(rel) = pc.checked_sub(self.base).and_then(|r| u32::try_from(r).ok()) else { return };
        // A row where the FDE before ended replaces that end.
        if self.rows.last() == Some(&encode_row_bits(rel, FDE_END)) {
            self.rows.pop();
        }
        self.rows.push(encode_row_bits(rel, rule));
    }
}

const fn encode_row_bits(pc: u32, rule: u32) -> u64 {
    (pc as u64) << 32 | rule as u64
}

/// Sorts rows and merges them in place: of several rows at one pc the last wins (an FDE's
/// row over an FDE's end), an FDE end becomes the frame-pointer rule, a row of the same
/// rule as the one before is dropped; then rebases them on the first row's pc, which it
/// gives (None if there is no row).
fn merge(rows: &mut Vec<u64>) -> Option<u32> {
    rows.sort_unstable();
    let mut kept = 0;
    for i in 0..rows.len() {
        let row = rows[i];
        if rows.get(i + 1).is_some_and(|&next| row_pc(next) == row_pc(row)) {
            continue;
        }
        let row = if row as u32 == FDE_END { encode_row(row_pc(row), UnwindRule::FRAME_POINTER) } else { row };
        if kept > 0 && rows[kept - 1] as u32 == row as u32 {
            continue;
        }
        rows[kept] = row;
        kept += 1;
    }
    rows.truncate(kept);
    let first = row_pc(*rows.first()?);
    for row in rows.iter_mut() {
        *row -= u64::from(first) << 32;
    }
    // (The room reserved ahead goes back: a table without a disk cache is kept.)
    rows.shrink_to_fit();
    Some(first)
}

/// The lowest address an FDE of `section` starts at.
fn lowest_start<R: Reader<Offset = usize>, S: UnwindSection<R>>(section: &S, bases: &BaseAddresses) -> Option<u64> {
    let mut entries = section.entries(bases);
    let mut lowest = None;
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(S::cie_from_offset) else { continue };
        if fde.initial_address() < fde.end_address() {
            lowest = Some(lowest.map_or(fde.initial_address(), |l: u64| l.min(fde.initial_address())));
        }
    }
    lowest
}

/// Appends the rows of every FDE of `section` that does not overlap `skip` (sorted spans a
/// section read before covers), and records the spans it covered. Of consecutive rows of
/// one FDE with the same rule only the first is kept (many rows of a big library's FDEs
/// only change where a callee-saved register other than rbp is).
fn fde_rows<R: Reader<Offset = usize>, S: UnwindSection<R>>(
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    skip: &[(u64, u64)],
    out: &mut Rows<'_>,
    covered: &mut Vec<(u64, u64)>,
) {
    // One FDE's rows (pc, rule bits), merged as they come.
    let mut fde: Vec<(u64, u32)> = Vec::new();
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(entry) = partial.parse(S::cie_from_offset) else { continue };
        let (start, end) = (entry.initial_address(), entry.end_address());
        if start >= end {
            continue;
        }
        if overlaps(skip, start, end) {
            continue; // the other section already describes this code
        }
        covered.push((start, end));
        let signal_frame = entry.is_signal_trampoline();
        let Ok(mut table) = entry.rows(section, bases, ctx) else { continue };
        fde.clear();
        while let Ok(Some(row)) = table.next_row() {
            let pc = row.start_address();
            if pc >= end {
                continue; // past the FDE (a row of no length at its end): the end's row holds there
            }
            let rule = encode_rule(summarize(section, row, signal_frame).map_or(UnwindRule::STOP, rule_for));
            add_fde_row(&mut fde, pc, rule);
        }
        for &(pc, rule) in &fde {
            out.push(pc, rule);
        }
        out.push(end, FDE_END);
    }
}

/// Adds a row to one FDE's rows: of rows at one pc the later one is in effect (a row of no
/// length: clang's CFI restores rbp at the instruction after its `pop`, after another row
/// there), and a row of the rule before it adds nothing.
fn add_fde_row(fde: &mut Vec<(u64, u32)>, pc: u64, rule: u32) {
    if fde.last().is_some_and(|&(at, _)| at == pc) {
        fde.pop();
    }
    if fde.last().is_none_or(|&(_, before)| before != rule) {
        fde.push((pc, rule));
    }
}

fn summarize<R: Reader<Offset = usize>, S: UnwindSection<R>>(
    section: &S,
    row: &UnwindTableRow<usize>,
    signal_frame: bool,
) -> Option<RowSummary> {
    let cfa = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => Cfa::Sp(*offset),
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => Cfa::Bp(*offset),
        CfaRule::RegisterAndOffset { .. } => Cfa::Other,
        CfaRule::Expression(expr) => {
            let bytes = expr.get(section).ok()?.0.to_slice().ok()?.into_owned();
            bp_deref_offset(&bytes).map_or(Cfa::Other, Cfa::BpDeref)
        }
    };
    let saved = |reg: Register| match row.register(reg) {
        None | Some(RegisterRule::SameValue) => Saved::Unchanged,
        Some(RegisterRule::Undefined) => Saved::Undefined,
        Some(RegisterRule::Offset(o)) => Saved::At(o),
        Some(_) => Saved::Other,
    };
    let ra = match row.register(X86_64::RA) {
        // The return address column is always described; absent means undefined.
        None => Saved::Undefined,
        Some(RegisterRule::Register(r)) if r == X86_64::RDI => Saved::InRdi,
        _ => saved(X86_64::RA),
    };
    Some(RowSummary { signal_frame, cfa, ra, rbp: saved(X86_64::RBP) })
}

/// N of the expression `DW_OP_breg6 (rbp) N; DW_OP_deref`.
pub fn bp_deref_offset(expr: &[u8]) -> Option<i64> {
    const DW_OP_BREG6: u8 = 0x76;
    const DW_OP_DEREF: u8 = 0x06;
    let (&op, rest) = expr.split_first()?;
    if op != DW_OP_BREG6 {
        return None;
    }
    let (value, used) = sleb128(rest)?;
    (rest.get(used..) == Some(&[DW_OP_DEREF][..])).then_some(value)
}

fn sleb128(bytes: &[u8]) -> Option<(i64, usize)> {
    let mut value: i64 = 0;
    let mut shift = 0u32;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= i64::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            if shift < 64 && b & 0x40 != 0 {
                value |= -1i64 << shift;
            }
            return Some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::unwind::decode_rule;

    fn row(cfa: Cfa, ra: Saved, rbp: Saved) -> RowSummary {
        RowSummary { signal_frame: false, cfa, ra, rbp }
    }

    #[test]
    fn rows_become_rules_the_probes_can_walk() {
        let r = rule_for(row(Cfa::Sp(8), Saved::At(-8), Saved::Unchanged));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (kind::CFA_SP, 8, 0));
        let r = rule_for(row(Cfa::Bp(16), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (kind::CFA_BP, 16, -16));
        let r = rule_for(row(Cfa::BpDeref(-8), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset), (kind::CFA_BP_DEREF, -8));
        assert_eq!(rule_for(row(Cfa::Sp(8), Saved::Undefined, Saved::Unchanged)).kind, kind::OUTERMOST);
        // glibc's vfork after its `pop %rdi`: CFA = rsp, the return address in %rdi.
        let r = rule_for(row(Cfa::Sp(0), Saved::InRdi, Saved::Unchanged));
        assert_eq!((r.kind, r.cfa_offset), (kind::RA_RDI, 0));
        assert_eq!(decode_rule(encode_rule(r)), r);
        assert_eq!(
            rule_for(RowSummary { signal_frame: true, ..row(Cfa::Other, Saved::Other, Saved::Other) }).kind,
            kind::SIGNAL
        );
        // What the probes cannot follow stops the walk rather than guessing.
        for r in [
            row(Cfa::Other, Saved::At(-8), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-16), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::Other, Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-8), Saved::Other),
            row(Cfa::Sp(1 << 40), Saved::At(-8), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-8), Saved::At(1 << 20)),
            row(Cfa::Bp(8), Saved::InRdi, Saved::Unchanged),
            row(Cfa::Sp(8), Saved::InRdi, Saved::At(-16)),
        ] {
            assert_eq!(rule_for(r).kind, kind::STOP, "{r:?}");
        }
    }

    #[test]
    fn realigned_frame_expressions_are_recognised() {
        assert_eq!(bp_deref_offset(&[0x76, 0x78, 0x06]), Some(-8));
        assert_eq!(bp_deref_offset(&[0x76, 0x10, 0x06]), Some(16));
        assert_eq!(bp_deref_offset(&[0x76, 0x78]), None);
        assert_eq!(bp_deref_offset(&[0x77, 0x08, 0x06]), None);
        assert_eq!(bp_deref_offset(&[0x76, 0x78, 0x06, 0x23]), None);
        assert_eq!(bp_deref_offset(&[]), None);
    }

    #[test]
    fn an_fdes_rows_keep_the_later_row_at_a_pc_and_drop_repeats() {
        let mut fde = Vec::new();
        for (pc, rule) in [(0x10, 1), (0x11, 2), (0x20, 2), (0x30, 3), (0x30, 1), (0x31, 4), (0x31, 1), (0x40, 5)] {
            add_fde_row(&mut fde, pc, rule);
        }
        // 0x20 repeats 0x11's rule; at 0x30 the later row (1) wins; at 0x31 the later row
        // is 1 again, so nothing changes from 0x30.
        assert_eq!(fde, [(0x10, 1), (0x11, 2), (0x30, 1), (0x40, 5)]);
    }

    #[test]
    fn merging_sorts_lets_an_fde_row_win_over_an_end_and_rebases() {
        let fp = encode_rule(UnwindRule::FRAME_POINTER);
        let row = |pc: u32, rule: u32| encode_row_bits(pc, rule);
        let mut rows = vec![
            row(0x200, 7),
            row(0x100, 7),
            row(0x180, FDE_END),
            row(0x200, FDE_END),
            row(0x180, 9),
            row(0x300, FDE_END),
            row(0x280, 7),
            row(0x400, fp),
        ];
        assert_eq!(merge(&mut rows), Some(0x100));
        // 0x180: the FDE row, not the end; 0x200 and 0x280 repeat rule 7; 0x300's end is
        // the frame-pointer rule, and 0x400 repeats it.
        assert_eq!(rows, [row(0, 7), row(0x80, 9), row(0x100, 7), row(0x200, fp)]);
        assert_eq!(merge(&mut Vec::new()), None);
    }

    /// A debuginfo file (`objcopy --only-keep-debug`), whose `.eh_frame` is NOBITS: a slice of
    /// nothing, not inside the file's bytes (its offset underflowed before), read as no
    /// section: no FDE row comes of it.
    #[test]
    fn a_debuginfo_file_without_cfi_bytes_is_read_without_panic() {
        let exe = std::env::current_exe().unwrap();
        let out = std::env::temp_dir().join(format!("memtrace-cfi-debuginfo-{}", std::process::id()));
        let status = std::process::Command::new("objcopy").arg("--only-keep-debug").arg(&exe).arg(&out).status();
        assert!(status.is_ok_and(|s| s.success()), "objcopy --only-keep-debug");
        let cfi = Cfi::open(&out);
        let _ = std::fs::remove_file(&out);
        let cfi = cfi.unwrap();
        assert!(cfi.eh_frame.is_none(), "a NOBITS .eh_frame is no section");
        // At most the entry code's rows (the outermost frame, then the frame pointer).
        assert!(cfi.table().is_none_or(|t| t.row_count() <= 2));
    }

    /// Every address an FDE row of our own executable covers gets that row's rule from its
    /// table, by the probes' lookup (rows of no length left out: the row after them at
    /// their pc is in effect).
    #[test]
    fn every_address_an_fde_row_covers_gets_its_rule() {
        let exe = std::env::current_exe().unwrap();
        let cfi = Cfi::open(&exe).unwrap();
        let table = cfi.table().unwrap();
        let mut eh = EhFrame::from(cfi.section(&cfi.eh_frame).unwrap());
        eh.set_address_size(8);
        let mut ctx = Box::new(UnwindContext::new());
        let mut entries = eh.entries(&cfi.bases);
        let (mut checked, mut empty) = (0, 0);
        while let Some(entry) = entries.next().unwrap() {
            let CieOrFde::Fde(partial) = entry else { continue };
            let fde = partial.parse(EhFrame::cie_from_offset).unwrap();
            let mut rows = fde.rows(&eh, &cfi.bases, &mut ctx).unwrap();
            while let Some(row) = rows.next_row().unwrap() {
                if row.start_address() == row.end_address() {
                    empty += 1;
                    continue;
                }
                let rule = summarize(&eh, row, fde.is_signal_trampoline()).map_or(UnwindRule::STOP, rule_for);
                let want = memtrace_common::unwind::decode_rule(encode_rule(rule));
                for pc in [row.start_address(), row.end_address() - 1] {
                    assert_eq!(table.rule_at(pc), want, "{pc:#x}");
                }
                checked += 1;
            }
        }
        assert!(checked > 10_000, "{checked} rows");
        eprintln!("{checked} rows checked, {empty} of no length");
    }

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    /// Our own executable's rows: sorted, merged, and a function's first instruction has
    /// CFA = rsp + 8 (the FDE's row wins over the end of the function before it).
    #[test]
    fn the_rows_of_a_real_binary() {
        let maps = crate::procfs::Maps::read_self().unwrap();
        let ip = marker();
        let m = maps.find(ip).unwrap();
        let cfi = Cfi::open(&m.path).unwrap();
        let table = cfi.table().unwrap();
        let rows = table.decoded_rows();
        assert!(rows.len() > 1000, "{} rows", rows.len());
        assert!(rows.windows(2).all(|w| w[0].pc < w[1].pc && w[0].rule != w[1].rule));
        assert_eq!(rows[0].pc, table.pc_base, "the table's base is its first row's pc");
        let vaddr = vaddr_of_file_offset(&cfi.segments, m.file_offset(ip)).unwrap();
        let at = rows.partition_point(|r| r.pc <= vaddr) - 1;
        assert_eq!(rows[at].pc, vaddr, "a row starts at the function's entry");
        assert_eq!((rows[at].rule.kind, rows[at].rule.cfa_offset), (kind::CFA_SP, 8));
    }
}
