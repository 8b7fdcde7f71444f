//! Reading the kernel's own type information (`/sys/kernel/btf/vmlinux`): the byte offsets
//! of the structure fields the probes read (`task_struct.tgid`, `kmem_cache.size`,
//! `linux_binprm.filename`, …) and the parameters of the functions they attach to, so the
//! programs carry no layout compiled for one kernel. Only what memtrace needs: structs,
//! unions and their members (through anonymous members), typedef/qualifier chains, function
//! prototypes.
use std::{
    collections::HashMap,
    hash::{BuildHasherDefault, Hasher},
    path::Path,
};

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF data (bad magic or header)")]
    BadHeader,
    #[error("BTF data is truncated")]
    Truncated,
    #[error("unknown BTF type kind {0}")]
    UnknownKind(u32),
    #[error("the kernel's BTF has no struct {0}")]
    NoStruct(String),
    #[error("the kernel's BTF has no field {field} in struct {strukt}")]
    NoField { strukt: String, field: String },
    #[error("the kernel's BTF has no function {0}")]
    NoFunction(String),
}

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FWD: u32 = 7;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_FLOAT: u32 = 16;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, Clone)]
struct Member {
    name: u32,
    ty: u32,
    /// Bit offset in the containing struct.
    bit_offset: u32,
}

#[derive(Debug, Clone)]
enum Type {
    /// A struct or union: its size and members.
    Composite {
        name: u32,
        size: u32,
        members: Vec<Member>,
    },
    /// typedef, const, volatile, restrict, type tag: another type (under a name, for a
    /// typedef).
    Alias {
        name: u32,
        target: u32,
        typedef: bool,
    },
    Func {
        name: u32,
        proto: u32,
    },
    /// Parameters: (name, type).
    Proto(Vec<(u32, u32)>),
    Ptr(u32),
    Array {
        elem: u32,
        count: u32,
    },
    /// Any type with a size (int, enum, float).
    Sized(u32),
    Other,
}

/// Type ids by the hash of their name ([`name_hash`]): building the indexes of a kernel's
/// ~150k names hashes their bytes where they lie, with no string allocated per name
/// (which took most of the 30–40 ms parse). A lookup checks the name it finds; two names
/// with one hash (never seen) fall back to a scan.
type NameIndex = HashMap<u64, u32, BuildHasherDefault<Prehashed>>;

/// The hasher of keys that are hashes already.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// FNV-1a of a name's bytes.
fn name_hash(name: &[u8]) -> u64 {
    name.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The kernel's type information.
pub struct Btf {
    types: Vec<Type>,
    strings: Vec<u8>,
    structs: NameIndex,
    funcs: NameIndex,
    typedefs: NameIndex,
}

/// Where a field lies: byte offset from the start of the outer struct, and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub offset: u32,
    pub size: u32,
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, BtfError> {
    let bytes = data.get(at..at + 4).ok_or(BtfError::Truncated)?;
    Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
}

impl Btf {
    /// The running kernel's BTF.
    pub fn vmlinux() -> anyhow::Result<Self> {
        let path = Path::new("/sys/kernel/btf/vmlinux");
        let data = std::fs::read(path).map_err(|e| {
            anyhow::anyhow!(
                "reading {}: {e} (memtrace needs a kernel built with BTF, CONFIG_DEBUG_INFO_BTF)",
                path.display()
            )
        })?;
        Ok(Self::parse(&data)?)
    }

    pub fn parse(data: &[u8]) -> Result<Self, BtfError> {
        if data.len() < 24 || data[0..2] != [0x9f, 0xeb] {
            return Err(BtfError::BadHeader);
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let types_data = data.get(hdr_len + type_off..hdr_len + type_off + type_len).ok_or(BtfError::Truncated)?;
        let strings = data.get(hdr_len + str_off..hdr_len + str_off + str_len).ok_or(BtfError::Truncated)?.to_vec();
        // Type ids start at 1; index 0 stands for void.
        let mut types = vec![Type::Other];
        let mut at = 0;
        while at < types_data.len() {
            let name = u32_at(types_data, at)?;
            let info = u32_at(types_data, at + 4)?;
            let size_or_type = u32_at(types_data, at + 8)?;
            at += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 != 0;
            let ty = match kind {
                KIND_INT => {
                    at += 4;
                    Type::Sized(size_or_type)
                }
                KIND_PTR => Type::Ptr(size_or_type),
                KIND_ARRAY => {
                    let elem = u32_at(types_data, at)?;
                    let count = u32_at(types_data, at + 8)?;
                    at += 12;
                    Type::Array { elem, count }
                }
                KIND_STRUCT | KIND_UNION => {
                    let mut members = Vec::with_capacity(vlen);
                    for _ in 0..vlen {
                        let offset = u32_at(types_data, at + 8)?;
                        members.push(Member {
                            name: u32_at(types_data, at)?,
                            ty: u32_at(types_data, at + 4)?,
                            bit_offset: if kind_flag { offset & 0xff_ffff } else { offset },
                        });
                        at += 12;
                    }
                    Type::Composite { name, size: size_or_type, members }
                }
                KIND_ENUM => {
                    at += 8 * vlen;
                    Type::Sized(size_or_type)
                }
                KIND_ENUM64 => {
                    at += 12 * vlen;
                    Type::Sized(size_or_type)
                }
                KIND_FWD => Type::Other,
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    Type::Alias { name, target: size_or_type, typedef: kind == KIND_TYPEDEF }
                }
                KIND_FUNC => Type::Func { name, proto: size_or_type },
                KIND_FUNC_PROTO => {
                    let mut params = Vec::with_capacity(vlen);
                    for _ in 0..vlen {
                        params.push((u32_at(types_data, at)?, u32_at(types_data, at + 4)?));
                        at += 8;
                    }
                    Type::Proto(params)
                }
                KIND_VAR => {
                    at += 4;
                    Type::Other
                }
                KIND_DATASEC => {
                    at += 12 * vlen;
                    Type::Other
                }
                KIND_FLOAT => Type::Sized(size_or_type),
                KIND_DECL_TAG => {
                    at += 4;
                    Type::Other
                }
                other => return Err(BtfError::UnknownKind(other)),
            };
            types.push(ty);
        }
        let mut btf = Self {
            types,
            strings,
            structs: NameIndex::default(),
            funcs: NameIndex::default(),
            typedefs: NameIndex::default(),
        };
        let (mut structs, mut funcs, mut typedefs) = (NameIndex::default(), NameIndex::default(), NameIndex::default());
        for (id, ty) in btf.types.iter().enumerate() {
            let (index, name) = match ty {
                // The first struct of a name wins (a kernel has one of each that matters).
                Type::Composite { name, members, .. } if *name != 0 && !members.is_empty() => (&mut structs, *name),
                Type::Func { name, .. } => (&mut funcs, *name),
                Type::Alias { name, typedef: true, .. } if *name != 0 => (&mut typedefs, *name),
                _ => continue,
            };
            index.entry(name_hash(btf.name_bytes(name))).or_insert(id as u32);
        }
        (btf.structs, btf.funcs, btf.typedefs) = (structs, funcs, typedefs);
        Ok(btf)
    }

    fn name_bytes(&self, offset: u32) -> &[u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// The name a type has (0 for none).
    fn name_of(&self, id: u32) -> u32 {
        match self.types.get(id as usize) {
            Some(Type::Composite { name, .. } | Type::Alias { name, .. } | Type::Func { name, .. }) => *name,
            _ => 0,
        }
    }

    /// The id `index` gives `name`, checked; a scan of every type `wanted` accepts when
    /// the hash is another name's.
    fn lookup(&self, index: &NameIndex, name: &str, wanted: impl Fn(&Type) -> bool) -> Option<u32> {
        let named = |id: u32| self.name_bytes(self.name_of(id)) == name.as_bytes();
        match index.get(&name_hash(name.as_bytes())) {
            Some(&id) if named(id) => Some(id),
            Some(_) => (0..self.types.len() as u32).find(|&id| named(id) && wanted(&self.types[id as usize])),
            None => None,
        }
    }

    fn struct_id(&self, name: &str) -> Option<u32> {
        self.lookup(&self.structs, name, |t| matches!(t, Type::Composite { members, .. } if !members.is_empty()))
    }

    fn func_id(&self, name: &str) -> Option<u32> {
        self.lookup(&self.funcs, name, |t| matches!(t, Type::Func { .. }))
    }

    fn typedef_id(&self, name: &str) -> Option<u32> {
        self.lookup(&self.typedefs, name, |t| matches!(t, Type::Alias { typedef: true, .. }))
    }

    fn string(&self, offset: u32) -> &str {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    /// Follows typedefs and qualifiers.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.types.get(id as usize) {
                Some(Type::Alias { target, .. }) => id = *target,
                _ => break,
            }
        }
        id
    }

    fn size_of(&self, id: u32) -> u32 {
        match self.types.get(self.resolve(id) as usize) {
            Some(Type::Composite { size, .. } | Type::Sized(size)) => *size,
            Some(Type::Ptr(_)) => 8,
            Some(Type::Array { elem, count }) => self.size_of(*elem).saturating_mul(*count),
            _ => 0,
        }
    }

    /// The size of `struct name`.
    pub fn struct_size(&self, name: &str) -> Result<u32, BtfError> {
        let id = self.struct_id(name).ok_or_else(|| BtfError::NoStruct(name.into()))?;
        Ok(self.size_of(id))
    }

    /// A member of `struct strukt` named by a dotted path (`thread.fsbase`); members of
    /// anonymous structs and unions are found as if they were the outer struct's.
    pub fn field(&self, strukt: &str, path: &str) -> Result<Field, BtfError> {
        let not_found = || BtfError::NoField { strukt: strukt.into(), field: path.into() };
        let mut id = self.struct_id(strukt).ok_or_else(|| BtfError::NoStruct(strukt.into()))?;
        let mut offset_bits = 0u32;
        let mut size = 0;
        for part in path.split('.') {
            let (bits, ty) = self.member(id, part, 0).ok_or_else(not_found)?;
            offset_bits += bits;
            size = self.size_of(ty);
            id = self.resolve(ty);
        }
        if !offset_bits.is_multiple_of(8) {
            return Err(not_found()); // a bitfield: not a whole field the probes can read
        }
        Ok(Field { offset: offset_bits / 8, size })
    }

    /// (bit offset, type) of member `name` of composite `id`, looking into anonymous
    /// members.
    fn member(&self, id: u32, name: &str, depth: u32) -> Option<(u32, u32)> {
        let Some(Type::Composite { members, .. }) = self.types.get(self.resolve(id) as usize) else { return None };
        for m in members {
            if m.name != 0 && self.string(m.name) == name {
                return Some((m.bit_offset, m.ty));
            }
        }
        if depth < 8 {
            for m in members.iter().filter(|m| m.name == 0) {
                if let Some((bits, ty)) = self.member(m.ty, name, depth + 1) {
                    return Some((m.bit_offset + bits, ty));
                }
            }
        }
        None
    }

    /// The parameter names of a kernel function, in order.
    pub fn function_params(&self, name: &str) -> Result<Vec<String>, BtfError> {
        let id = self.func_id(name).ok_or_else(|| BtfError::NoFunction(name.into()))?;
        let Some(Type::Func { proto, .. }) = self.types.get(id as usize) else {
            return Err(BtfError::NoFunction(name.into()));
        };
        match self.types.get(self.resolve(*proto) as usize) {
            Some(Type::Proto(params)) => Ok(params.iter().map(|(n, _)| self.string(*n).to_string()).collect()),
            _ => Err(BtfError::NoFunction(name.into())),
        }
    }

    /// The number of arguments a raw tracepoint passes its programs (the `btf_trace_NAME`
    /// prototype, whose first parameter is the tracepoint's private data, not counted).
    pub fn tracepoint_args(&self, name: &str) -> Option<usize> {
        let id = self.typedef_id(&format!("btf_trace_{name}"))?;
        let Some(Type::Alias { target, .. }) = self.types.get(id as usize) else { return None };
        let Some(Type::Ptr(proto)) = self.types.get(self.resolve(*target) as usize) else { return None };
        match self.types.get(self.resolve(*proto) as usize) {
            Some(Type::Proto(params)) => Some(params.len().saturating_sub(1)),
            _ => None,
        }
    }

    /// Whether the kernel has a function (to attach fentry/fexit programs to).
    pub fn has_function(&self, name: &str) -> bool {
        self.func_id(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmlinux() -> Btf {
        Btf::vmlinux().expect("these machines have kernel BTF")
    }

    #[test]
    fn finds_fields_of_the_running_kernel() {
        let btf = vmlinux();
        let tgid = btf.field("task_struct", "tgid").unwrap();
        let pid = btf.field("task_struct", "pid").unwrap();
        assert_eq!((tgid.size, pid.size), (4, 4));
        assert_eq!(tgid.offset, pid.offset + 4, "tgid follows pid");
        // A nested field.
        let fsbase = btf.field("task_struct", "thread.fsbase").unwrap();
        assert_eq!(fsbase.size, 8);
        assert!(fsbase.offset > tgid.offset);
        assert_eq!(btf.field("kmem_cache", "size").unwrap().size, 4);
        assert_eq!(btf.field("linux_binprm", "filename").unwrap().size, 8);
        assert!(btf.struct_size("page").unwrap() >= 64);
        assert!(matches!(btf.field("task_struct", "no_such_field"), Err(BtfError::NoField { .. })));
        assert!(matches!(btf.struct_size("no_such_struct"), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn a_name_whose_hash_another_name_took_is_found_by_a_scan() {
        let mut btf = vmlinux();
        let task = btf.field("task_struct", "tgid").unwrap();
        let page = btf.struct_id("page").unwrap();
        btf.structs.insert(name_hash(b"task_struct"), page);
        btf.funcs.insert(name_hash(b"schedule"), page);
        assert_eq!(btf.field("task_struct", "tgid").unwrap(), task);
        assert!(btf.has_function("schedule"));
        assert!(btf.struct_id("no_such_struct").is_none());
    }

    #[test]
    fn finds_function_parameters() {
        let btf = vmlinux();
        let params = btf.function_params("do_mmap").unwrap();
        assert_eq!(&params[..4], ["file", "addr", "len", "prot"]);
        assert!(btf.has_function("begin_new_exec"));
        assert_eq!(btf.tracepoint_args("kfree"), Some(2));
        assert_eq!(btf.tracepoint_args("kmalloc"), Some(6));
        assert_eq!(btf.tracepoint_args("no_such_tracepoint"), None);
        assert!(!btf.has_function("no_such_function_here"));
    }

    #[test]
    #[ignore = "prints what the probes read; run by hand"]
    fn print_layouts() {
        let btf = vmlinux();
        for t in super::super::verify::KERNEL_PROGRAMS.iter().chain(&super::super::verify::TASK_PROGRAMS) {
            println!("tp {t}: {:?}", btf.tracepoint_args(t));
        }
        for f in
            ["do_mmap", "begin_new_exec", "security_file_open", "kmem_cache_free_bulk", "kmem_cache_alloc_bulk_noprof"]
        {
            println!("{f}: {:?}", btf.function_params(f));
        }
        for (s, f) in [
            ("task_struct", "mm"),
            ("task_struct", "tgid"),
            ("task_struct", "pid"),
            ("task_struct", "real_parent"),
            ("linux_binprm", "filename"),
            ("linux_binprm", "interp"),
            ("file", "f_inode"),
            ("inode", "i_ino"),
            ("inode", "i_sb"),
            ("super_block", "s_dev"),
            ("file", "f_path"),
            ("kmem_cache", "name"),
            ("kmem_cache", "object_size"),
            ("kmem_cache", "size"),
            ("mm_struct", "start_code"),
            ("task_struct", "thread.fsbase"),
            ("task_struct", "files"),
            ("files_struct", "fdt"),
            ("fdtable", "fd"),
            ("linux_binprm", "file"),
            ("linux_binprm", "interpreter"),
        ] {
            println!("{s}.{f}: {:?}", btf.field(s, f));
        }
    }

    #[test]
    fn bad_data_is_an_error_not_a_panic() {
        assert_eq!(Btf::parse(b"").err(), Some(BtfError::BadHeader));
        assert_eq!(Btf::parse(&[0u8; 64]).err(), Some(BtfError::BadHeader));
        let data = std::fs::read("/sys/kernel/btf/vmlinux").unwrap();
        for len in [24, 100, data.len() / 2] {
            assert!(Btf::parse(&data[..len]).is_err(), "{len}");
        }
    }
}
