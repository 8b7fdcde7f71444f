//! Just enough ELF reading for memtrace: defined function symbols and their file offsets
//! (where uprobes go), DT_NEEDED / RUNPATH (to find the allocator a program will load), and
//! GNU build ids (to name code independently of where it was mapped).
use std::{collections::HashMap, fs::File, path::Path};

use anyhow::{Context as _, Result};
use memmap2::Mmap;
use object::{
    Endianness, Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind, elf,
    read::elf::{Dyn as _, ElfFile64, FileHeader as _, ProgramHeader as _, VersionTable},
};

/// A function in an ELF file: where its code starts in the file, and its size (0 when
/// the symbol does not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Function {
    pub offset: u64,
    pub size: u64,
}

/// A symbol of any kind: where it loads, where its bytes are in the file (None for
/// `.bss`), its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSymbol {
    pub vaddr: u64,
    pub offset: Option<u64>,
    pub size: u64,
}

/// Hands a read-only file mapping's resident pages back to the page cache (they stay
/// cached; a later read faults them in again): for big files read once or rarely.
pub fn forget_resident(map: &Mmap) {
    // SAFETY: memmap2's `Mmap` is a read-only (shared) mapping that nothing in memtrace
    // writes, so no page is dirty: MADV_DONTNEED only unmaps its pages, and every later
    // read (through references into the mapping, which stay valid) faults the file's same
    // bytes in again from the page cache. (The files are ELF objects and cache entries,
    // replaced by rename, never rewritten in place.)
    let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
}

/// Symbols read between two hand-backs of a scan's pages ([`ElfFile::all_symbols`]).
const SYMBOLS_RESIDENT: usize = 1 << 16;

type ElfSymbol<'a> = object::read::elf::ElfSymbol64<'a, 'a, Endianness>;

/// An ELF file mapped read-only.
pub struct ElfFile {
    map: Mmap,
}

impl ElfFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the mapping is read-only and private; a concurrent truncation of the file
        // could fault, which is the same risk every ELF reader (including ld.so) accepts.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        Ok(Self { map })
    }

    fn parse(&self) -> Result<ElfFile64<'_, Endianness>> {
        ElfFile64::parse(&*self.map).context("not a 64-bit ELF file")
    }

    /// Every symbol, dynamic ones first, the pages read handed back to the page cache every
    /// [`SYMBOLS_RESIDENT`] symbols: a scan of a big library's names reads all of them
    /// (libtorch_cpu.so's 546,000 symbols name themselves in 78 MB), which counted in
    /// memtrace's resident memory until the file was closed.
    fn all_symbols<'a>(&'a self, file: &'a ElfFile64<'a, Endianness>) -> impl Iterator<Item = ElfSymbol<'a>> + 'a {
        self.symbols_forgetting(file, SYMBOLS_RESIDENT)
    }

    fn symbols_forgetting<'a>(
        &'a self,
        file: &'a ElfFile64<'a, Endianness>,
        every: usize,
    ) -> impl Iterator<Item = ElfSymbol<'a>> + 'a {
        file.dynamic_symbols().chain(file.symbols()).enumerate().map(move |(i, symbol)| {
            if i % every == every - 1 {
                self.forget_read();
            }
            symbol
        })
    }

    /// Drops the mapping's resident pages: a later read faults them in again, from the page
    /// cache.
    fn forget_read(&self) {
        forget_resident(&self.map);
    }

    pub fn build_id(&self) -> Option<Vec<u8>> {
        let file = self.parse().ok()?;
        file.build_id().ok().flatten().map(<[u8]>::to_vec)
    }

    /// File offsets and sizes of the defined functions among `names` (dynamic symbols
    /// first, then the full symbol table for static executables).
    pub fn function_offsets(&self, names: &[&str]) -> Result<HashMap<String, Function>> {
        let wanted: std::collections::HashSet<&str> = names.iter().copied().collect();
        // Versioned dynamic names ("malloc@@GLIBC_2.2.5") are not in .dynsym names.
        self.functions_where(|name| wanted.contains(name))
    }

    /// The names of the defined functions ending in `suffix` (no allocation per symbol:
    /// cheap enough for every library a process maps).
    pub fn function_names_ending_with(&self, suffix: &str) -> Result<Vec<String>> {
        self.function_names_where(|name| name.ends_with(suffix))
    }

    /// The names of the defined functions `keep` accepts, each once.
    pub fn function_names_where(&self, keep: impl Fn(&str) -> bool) -> Result<Vec<String>> {
        let file = self.parse()?;
        let mut found: Vec<String> = Vec::new();
        for symbol in self.all_symbols(&file) {
            if symbol.kind() != SymbolKind::Text || !symbol.is_definition() {
                continue;
            }
            let Ok(name) = symbol.name() else { continue };
            if keep(name) && !found.iter().any(|f| f == name) {
                found.push(name.to_string());
            }
        }
        Ok(found)
    }

    /// The defined functions whose names start with one of `prefixes`, by name (no
    /// allocation for the others: libarrow's 100k+ symbols took 107 ms read whole).
    pub fn functions_starting_with(&self, prefixes: &[&str]) -> Result<HashMap<String, Function>> {
        self.functions_where(|name| prefixes.iter().any(|p| name.starts_with(p)))
    }

    /// Every defined function (dynamic symbols first, then the full symbol table), by name.
    pub fn functions(&self) -> Result<HashMap<String, Function>> {
        self.functions_where(|_| true)
    }

    /// The defined functions whose names `keep` accepts, by name: the dynamic symbols
    /// first, then the full symbol table; a name's first definition wins.
    fn functions_where(&self, keep: impl Fn(&str) -> bool) -> Result<HashMap<String, Function>> {
        let file = self.parse()?;
        let mut found = HashMap::new();
        for symbol in self.all_symbols(&file) {
            if symbol.kind() != SymbolKind::Text || !symbol.is_definition() {
                continue;
            }
            let Ok(name) = symbol.name() else { continue };
            if !keep(name) || found.contains_key(name) {
                continue;
            }
            if let Some(offset) = vaddr_to_file_offset(&file, symbol.address()) {
                found.insert(name.to_string(), Function { offset, size: symbol.size() });
            }
        }
        Ok(found)
    }

    /// Whether the dynamic symbols define `name`, answered by the GNU hash table: a lookup,
    /// where reading every dynamic symbol took milliseconds per big library. None when the
    /// file has no such table (then only [`Self::function_offsets`] tells).
    pub fn dynamic_defines(&self, name: &str) -> Option<bool> {
        let file = self.parse().ok()?;
        let endian = file.endian();
        let sections = file.elf_section_table();
        // The lookup divides by the bucket count and masks by the filter's size: a file
        // whose table says 0 (or a filter size not a power of 2) is read the long way.
        let header = sections.gnu_hash_header(endian, file.data()).ok()??;
        let bloom = header.bloom_count.get(endian);
        if header.bucket_count.get(endian) == 0 || !bloom.is_power_of_two() {
            return None;
        }
        let (table, _) = sections.gnu_hash(endian, file.data()).ok()??;
        let symbols = file.elf_dynamic_symbol_table();
        if symbols.is_empty() {
            return None;
        }
        let versions = VersionTable::default();
        let hash = elf::gnu_hash(name.as_bytes());
        Some(table.find(endian, name.as_bytes(), hash, None, symbols, &versions).is_some())
    }

    /// A defined symbol of any kind (data too: `_PyRuntime`, `Py_Version`): its virtual
    /// address, its file offset when its bytes are in the file, and its size. Dynamic
    /// symbols first, then the full table.
    pub fn symbol(&self, name: &str) -> Result<Option<DataSymbol>> {
        let file = self.parse()?;
        for symbol in self.all_symbols(&file) {
            if !symbol.is_definition() || symbol.name() != Ok(name) {
                continue;
            }
            let vaddr = symbol.address();
            return Ok(Some(DataSymbol { vaddr, offset: vaddr_to_file_offset(&file, vaddr), size: symbol.size() }));
        }
        Ok(None)
    }

    /// The virtual address the byte at file `offset` loads at (None: in no loaded segment).
    pub fn vaddr_of_offset(&self, offset: u64) -> Option<u64> {
        let file = self.parse().ok()?;
        let endian = file.endian();
        let headers = file.elf_header().program_headers(endian, file.data()).ok()?;
        headers.iter().find_map(|ph| {
            let start = ph.p_offset(endian);
            let end = start + ph.p_filesz(endian);
            (ph.p_type(endian) == elf::PT_LOAD && (start..end.max(start + 1)).contains(&offset))
                .then(|| offset - start + ph.p_vaddr(endian))
        })
    }

    /// Up to `len` bytes of the file from `offset`.
    pub fn bytes(&self, offset: u64, len: usize) -> &[u8] {
        let start = (offset as usize).min(self.map.len());
        &self.map[start..(start + len).min(self.map.len())]
    }

    /// DT_NEEDED names and the RUNPATH/RPATH search directories (raw, `$ORIGIN` unexpanded).
    pub fn dynamic_deps(&self) -> Result<(Vec<String>, Vec<String>)> {
        let file = self.parse()?;
        let endian = file.endian();
        let data = &*self.map;
        let sections = file.elf_section_table();
        let mut needed = Vec::new();
        let mut runpath = Vec::new();
        // The index returned with the entries is the section's link: its string table.
        let Some((entries, strings_index)) = sections.dynamic(endian, data)? else {
            return Ok((needed, runpath));
        };
        let strings = sections.strings(endian, data, strings_index)?;
        for entry in entries {
            let Some(tag) = entry.tag32(endian) else {
                continue;
            };
            if !matches!(tag, elf::DT_NEEDED | elf::DT_RUNPATH | elf::DT_RPATH) {
                continue;
            }
            let Ok(value) = entry.string(endian, strings) else {
                continue;
            };
            let value = String::from_utf8_lossy(value).into_owned();
            if tag == elf::DT_NEEDED {
                needed.push(value);
            } else {
                runpath.extend(value.split(':').filter(|s| !s.is_empty()).map(str::to_string));
            }
        }
        Ok((needed, runpath))
    }

    /// The program interpreter (`PT_INTERP`: ld.so) the file asks for, if any.
    pub fn interpreter(&self) -> Option<String> {
        let file = self.parse().ok()?;
        let endian = file.endian();
        let headers = file.elf_header().program_headers(endian, file.data()).ok()?;
        headers.iter().find(|ph| ph.p_type(endian) == elf::PT_INTERP).and_then(|ph| {
            let bytes = ph.data(endian, file.data()).ok()?;
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
        })
    }

    /// Whether the file has a `.text` section (a real code object, not a data file).
    pub fn has_text(&self) -> bool {
        self.parse().map(|f| f.section_by_name(".text").is_some()).unwrap_or(false)
    }

    /// The file ranges `(start, end)` of the non-empty sections whose names `keep` takes.
    pub fn section_ranges(&self, keep: impl Fn(&str) -> bool) -> Vec<(u64, u64)> {
        let Ok(file) = self.parse() else { return Vec::new() };
        file.sections()
            .filter(|s| s.name().is_ok_and(&keep))
            .filter_map(|s| s.file_range())
            .filter(|&(_, len)| len > 0)
            .map(|(at, len)| (at, at + len))
            .collect()
    }
}

fn vaddr_to_file_offset(file: &ElfFile64<'_, Endianness>, vaddr: u64) -> Option<u64> {
    let endian = file.endian();
    let headers = file.elf_header().program_headers(endian, file.data()).ok()?;
    headers.iter().find_map(|ph| {
        let start = ph.p_vaddr(endian);
        let end = start + ph.p_filesz(endian);
        (ph.p_type(endian) == elf::PT_LOAD && (start..end).contains(&vaddr))
            .then(|| vaddr - start + ph.p_offset(endian))
    })
}

/// Build id of the ELF file at `path`, if it has one.
pub fn build_id(path: &Path) -> Option<Vec<u8>> {
    ElfFile::open(path).ok()?.build_id()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc_path() -> std::path::PathBuf {
        crate::procfs::Maps::read_self()
            .unwrap()
            .file_mappings()
            .map(|m| m.path.clone())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so")))
            .expect("test binary maps libc")
    }

    #[test]
    fn finds_malloc_and_its_build_id_in_our_own_libc() {
        let libc = ElfFile::open(&libc_path()).unwrap();
        let offsets = libc.function_offsets(&["malloc", "free", "no_such_function"]).unwrap();
        assert!(offsets["malloc"].offset > 0 && offsets["malloc"].size > 0);
        assert!(offsets["free"].offset > 0);
        assert!(!offsets.contains_key("no_such_function"));
        assert_eq!(libc.build_id().map(|id| id.len()), Some(20));
    }

    #[test]
    fn the_hash_table_answers_what_the_dynamic_symbols_define() {
        let libc = ElfFile::open(&libc_path()).unwrap();
        // Every function the dynamic symbols define, the lookup finds too; names not
        // defined (or only imported) it does not.
        let file = libc.parse().unwrap();
        let names: Vec<&str> = file
            .dynamic_symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.is_definition())
            .filter_map(|s| s.name().ok())
            .collect();
        assert!(names.len() > 1000, "{}", names.len());
        for name in names {
            assert_eq!(libc.dynamic_defines(name), Some(true), "{name}");
        }
        for name in ["cuInit", "no_such_function", "_dl_find_object_never", ""] {
            assert_eq!(libc.dynamic_defines(name), Some(false), "{name}");
        }
        // Our own executable imports malloc without defining it (its hash table, exporting
        // nothing, may be empty: then the lookup does not answer).
        let exe = ElfFile::open(&std::env::current_exe().unwrap()).unwrap();
        assert_ne!(exe.dynamic_defines("malloc"), Some(true));
    }

    /// Names read before the pages under them were handed back stay readable, and a scan
    /// that hands them back after every symbol reads what a plain one does.
    #[test]
    fn a_scan_that_hands_its_pages_back_reads_every_symbol_the_same() {
        let elf = ElfFile::open(&std::env::current_exe().unwrap()).unwrap();
        let file = elf.parse().unwrap();
        let plain: Vec<(String, u64)> = file
            .dynamic_symbols()
            .chain(file.symbols())
            .map(|s| (s.name().unwrap_or("").to_string(), s.address()))
            .collect();
        assert!(plain.len() > 10_000, "{} symbols", plain.len());
        let names: Vec<(&str, u64)> =
            elf.symbols_forgetting(&file, 1).map(|s| (s.name().unwrap_or(""), s.address())).collect();
        assert!(names.iter().map(|&(n, a)| (n.to_string(), a)).eq(plain.iter().cloned()));
    }

    #[test]
    fn reads_needed_libraries_of_our_own_executable() {
        let exe = ElfFile::open(&std::env::current_exe().unwrap()).unwrap();
        let (needed, _) = exe.dynamic_deps().unwrap();
        assert!(needed.iter().any(|n| n.starts_with("libc.so")), "{needed:?}");
    }
}
