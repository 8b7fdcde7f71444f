//! Allocation wrappers: functions that allocate on their caller's behalf (the standard
//! libraries' containers and `operator new`, libiberty's `xmalloc`, GLib's `g_malloc`,
//! CPython's `PyMem_Malloc`, ...). A user row named after its call site is named after the
//! first frame outside them, as a kernel page allocation's is after the page allocator's
//! caller: otherwise every site of a Rust program is `alloc::alloc::alloc` and GCC's are
//! `xmalloc ← [218 callers]`. Whole stacks keep these frames (marked `wrapper` in JSON).
//! Like valgrind massif's `--alloc-fn`, users add their own, or turn the list off.

/// Rust's and C++'s standard-library namespaces whose functions only allocate on their
/// caller's behalf when they are the innermost frames of an allocation (a container
/// growing, a string formatted, a node of a map), matched on the qualified name (a C++
/// return type and the parameters left out), or on an impl's self type (`<alloc::vec::Vec<T>
/// as Clone>::clone`) or, for a type that is no path (`<[T] as alloc::slice::…>::to_vec`),
/// its trait.
const NAMESPACES: &[&str] = &[
    "std::",
    "__gnu_cxx::",
    "alloc::",
    "hashbrown::",
    "core::fmt::",
    "core::iter::",
    "core::alloc::",
    "core::result::",
    "core::option::",
];

/// Functions (a trailing `*`: a prefix) that allocate for their caller.
const FUNCTIONS: &[&str] = &[
    // The C library's own names inlined in its callers (ld.so's `calloc` of
    // rtld-malloc.h, which calls the real one).
    "malloc",
    "calloc",
    "realloc",
    // C++'s allocation functions where they are not probed themselves.
    "operator new*",
    // Rust's global allocator shims.
    "__rust_alloc*",
    "__rust_realloc",
    "__rdl_*",
    "__rg_*",
    // The C library's string copies.
    "strdup",
    "strndup",
    "__strdup",
    "__strndup",
    "__GI___strdup",
    "__GI___strndup",
    // libiberty (GCC, binutils, GDB).
    "xmalloc",
    "xcalloc",
    "xrealloc",
    "xstrdup",
    "xstrndup",
    "xmemdup",
    // GLib.
    "g_malloc",
    "g_malloc0",
    "g_malloc_n",
    "g_malloc0_n",
    "g_realloc",
    "g_realloc_n",
    "g_try_malloc",
    "g_try_malloc0",
    "g_try_realloc",
    "g_strdup",
    "g_strndup",
    "g_memdup",
    "g_memdup2",
    "g_slice_alloc",
    "g_slice_alloc0",
    // SQLite's allocation API, in front of its (static, often stripped) malloc helper.
    "sqlite3_malloc",
    "sqlite3_malloc64",
    "sqlite3_realloc",
    "sqlite3_realloc64",
    "sqlite3Malloc",
    "sqlite3MallocZero",
    "sqlite3Realloc",
    "sqlite3DbMallocRaw",
    "sqlite3DbMallocRawNN",
    "sqlite3DbMallocZero",
    "sqlite3DbRealloc",
    "sqlite3DbReallocOrFree",
    "sqlite3DbStrDup",
    "sqlite3DbStrNDup",
    // GMP's default allocation functions.
    "__gmp_default_allocate",
    "__gmp_default_reallocate",
    // Perl's allocation functions (every allocation of the interpreter), and its strdup.
    "Perl_safesysmalloc",
    "Perl_safesyscalloc",
    "Perl_safesysrealloc",
    "Perl_savepv",
    "Perl_savepvn",
    "Perl_savesharedpv",
    "Perl_savesharedpvn",
    // CPython's allocator API, in front of the C library's malloc.
    "PyMem_Malloc",
    "PyMem_Calloc",
    "PyMem_Realloc",
    "PyMem_RawMalloc",
    "PyMem_RawCalloc",
    "PyMem_RawRealloc",
    "_PyMem_RawMalloc",
    "_PyMem_RawCalloc",
    "_PyMem_RawRealloc",
    "PyObject_Malloc",
    "PyObject_Calloc",
    "PyObject_Realloc",
    "_PyObject_Malloc",
    "_PyObject_Calloc",
    "_PyObject_Realloc",
];

/// `--alloc-fn`, shared by the commands that name sites.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AllocFnArgs {
    /// A function that allocates for its caller, as valgrind massif's --alloc-fn: a call
    /// site is named after its caller. Repeat for several; NAME* matches a prefix; `none`
    /// empties the list, built-in wrappers included (the Rust and C++ standard libraries'
    /// containers, operator new, strdup, xmalloc, g_malloc, sqlite3Malloc, Perl_safesysmalloc,
    /// PyMem_Malloc and the like).
    #[arg(long = "alloc-fn", value_name = "NAME")]
    pub alloc_fn: Vec<String>,
}

impl AllocFnArgs {
    pub fn alloc_fns(&self) -> AllocFns {
        AllocFns::from_args(&self.alloc_fn)
    }
}

/// The allocation wrappers a session skips when it names sites.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocFns {
    /// The built-in namespaces and functions above.
    builtin: bool,
    /// The user's (`--alloc-fn`): exact names, or prefixes (a trailing `*`).
    extra: Vec<String>,
}

impl Default for AllocFns {
    fn default() -> Self {
        Self { builtin: true, extra: Vec::new() }
    }
}

impl AllocFns {
    /// No wrapper at all: sites are the allocator's direct callers.
    pub fn none() -> Self {
        Self { builtin: false, extra: Vec::new() }
    }

    /// From `--alloc-fn` values, in order: a name (or `prefix*`) adds to the list; `none`
    /// empties it, the built-in ones included.
    pub fn from_args(args: &[String]) -> Self {
        let mut fns = Self::default();
        for a in args {
            match a.trim() {
                "none" => fns = Self::none(),
                "" => {}
                name => fns.extra.push(name.to_string()),
            }
        }
        fns
    }

    /// Whether a frame of this function is a wrapper's (a frame's source file unknown).
    #[cfg(test)]
    fn matches(&self, function: &str) -> bool {
        self.matches_frame(function, None)
    }

    /// Whether a frame of this function, from this source file, is a wrapper's: by name,
    /// or (built in) as code of the C++ or Rust standard library's sources, whose inlined
    /// template frames are named without their namespace (`_M_create<…>`,
    /// `thread<spawn()::<lambda()> >`) or not demangled at all.
    pub fn matches_frame(&self, function: &str, file: Option<&str>) -> bool {
        let q = qualified(function);
        self.extra.iter().any(|p| pattern_matches(p, function, q))
            || (self.builtin
                && (FUNCTIONS.iter().any(|p| pattern_matches(p, function, q))
                    || q.ends_with("::operator new")
                    || q.ends_with("::operator new[]")
                    || in_std(q)
                    || file.is_some_and(is_std_source)))
    }
}

/// Whether a source file is the C++ standard library's (libstdc++'s and libc++'s headers)
/// or Rust's (`/rustc/<hash>/library/…` as the toolchain's debug information names it, or
/// the rust-src component's copy).
fn is_std_source(file: &str) -> bool {
    file.contains("/include/c++/")
        || (file.starts_with("/rustc/") && file.contains("/library/"))
        || file.contains("/lib/rustlib/src/rust/library/")
}

/// `pattern` against a function's name, and its qualified name `q` ([`qualified`]).
fn pattern_matches(pattern: &str, function: &str, q: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => function.starts_with(prefix) || q.starts_with(prefix),
        None => function == pattern || q == pattern,
    }
}

/// Whether a qualified name belongs to one of [`NAMESPACES`].
fn in_std(q: &str) -> bool {
    let in_ns = |s: &str| NAMESPACES.iter().any(|ns| s.starts_with(ns));
    if let Some(inner) = q.strip_prefix('<') {
        // `<Type as Trait>::f` or `<Type>::f`.
        let (ty, tr) = split_impl(inner);
        return in_ns(ty) || (!is_path(ty) && tr.is_some_and(in_ns));
    }
    in_ns(q)
}

/// The self type and trait of an impl's name without its leading `<`: `Type as Trait>::f`.
fn split_impl(inner: &str) -> (&str, Option<&str>) {
    let mut depth = 0i32;
    for (i, c) in inner.char_indices() {
        match c {
            '<' | '[' | '(' => depth += 1,
            '>' | ']' | ')' if depth > 0 => depth -= 1,
            '>' if depth == 0 => return (&inner[..i], None),
            ' ' if depth == 0 && inner[i..].starts_with(" as ") => {
                let rest = &inner[i + 4..];
                return (&inner[..i], Some(rest));
            }
            _ => {}
        }
    }
    (inner, None)
}

/// Whether a type's name is a path (`alloc::vec::Vec<T>`), not `[T]`, `&str` or `T`.
fn is_path(ty: &str) -> bool {
    !ty.starts_with(['[', '&', '*', '(']) && ty.contains("::")
}

/// A function's qualified name without the return type and parameters a C++ demangler
/// writes: `std::vector<int>::_M_realloc_insert<int const&>` of `void
/// std::vector<int>::_M_realloc_insert<int const&>(iterator, int const&)`.
fn qualified(name: &str) -> &str {
    let mut depth = 0i32;
    let mut start = 0;
    let mut end = name.len();
    for (i, c) in name.char_indices() {
        match c {
            '<' | '[' => depth += 1,
            '>' | ']' if depth > 0 => depth -= 1,
            '(' if depth == 0 && i > 0 => {
                end = i;
                break;
            }
            // The space of `operator new` or of a conversion operator's type is no return
            // type's end.
            ' ' if depth == 0 && !name[..i].ends_with("operator") => start = i + 1,
            _ => {}
        }
    }
    &name[start.min(end)..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_allocation_plumbing_is_a_wrapper() {
        let f = AllocFns::default();
        for name in [
            "alloc::alloc::alloc",
            "alloc::raw_vec::RawVec<T,A>::grow_one",
            "<alloc::alloc::Global>::grow_impl_runtime",
            "<alloc::alloc::Global as core::alloc::Allocator>::allocate",
            "<alloc::vec::Vec<T> as core::clone::Clone>::clone",
            "<[T] as alloc::slice::hack::ConvertVec>::to_vec",
            "<str as alloc::string::ToString>::to_string",
            "hashbrown::raw::RawTable<T,A>::reserve_rehash",
            "std::collections::hash::map::HashMap<K,V,S>::insert",
            "core::iter::traits::iterator::Iterator::collect",
            "core::fmt::write",
            "__rust_alloc",
            "__rust_alloc_zeroed",
            "__rdl_realloc",
        ] {
            assert!(f.matches(name), "{name}");
        }
        for name in [
            "myapp::parse",
            "<myapp::Config as core::clone::Clone>::clone",
            "<myapp::Config as core::fmt::Display>::fmt",
            "core::ops::function::FnOnce::call_once",
            "main",
            "allocate_tables",
        ] {
            assert!(!f.matches(name), "{name}");
        }
    }

    #[test]
    fn cpp_standard_library_and_operator_new_are_wrappers() {
        let f = AllocFns::default();
        for name in [
            "operator new(unsigned long)",
            "operator new[](unsigned long)",
            "operator new(unsigned long, std::align_val_t)",
            "std::vector<int, std::allocator<int> >::_M_default_append(unsigned long)",
            "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
            "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_mutate(unsigned long, unsigned long, char const*, unsigned long)",
            "__gnu_cxx::new_allocator<int>::allocate(unsigned long, void const*)",
            "std::__1::vector<int>::__append(unsigned long)",
        ] {
            assert!(f.matches(name), "{name}");
        }
        for name in ["fill_vector(int)", "core::Engine::run()", "Node* make_node<int>(int)", "operator delete(void*)"] {
            assert!(!f.matches(name), "{name}");
        }
    }

    #[test]
    fn operators_and_standard_library_sources() {
        let f = AllocFns::default();
        // A user's conversion operator to a standard type is the user's code.
        assert!(!f.matches(
            "Name::operator std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >() const"
        ));
        assert!(!f.matches("Counter::operator unsigned long() const"));
        // A class's own operator new allocates for its caller.
        assert!(f.matches("Pool::operator new(unsigned long)") && f.matches("Pool::operator new[](unsigned long)"));
        // Inlined template frames named without their namespace, or mangled, are known by
        // their source file.
        for (name, file) in [
            ("_M_create<make_fn(int)::<lambda()> >", "/usr/include/c++/12/bits/std_function.h"),
            ("_ZSt11make_sharedI3BigJEESt10shared_ptrIT_EDpOT0_", "/usr/include/c++/12/bits/shared_ptr.h"),
            ("thread<spawn()::<lambda()> >", "/usr/include/c++/12/bits/std_thread.h"),
            ("__append", "/usr/lib/llvm-16/include/c++/v1/vector"),
            ("grow_one", "/rustc/59807616e0fc3e8c2c1fbd6ba1d9d4b1c3b4f5e6/library/alloc/src/raw_vec/mod.rs"),
            ("reserve", "/root/.rustup/toolchains/stable/lib/rustlib/src/rust/library/alloc/src/vec/mod.rs"),
        ] {
            assert!(f.matches_frame(name, Some(file)), "{name} {file}");
            assert!(!AllocFns::none().matches_frame(name, Some(file)), "{name}");
        }
        for file in ["/src/app/vector.h", "/home/me/include/c/x.h", "/rustc/library.rs"] {
            assert!(!f.matches_frame("fill", Some(file)), "{file}");
        }
        // A prefix is matched against the qualified name too.
        assert!(AllocFns::from_args(&["Pool::*".into()]).matches("void* Pool::get<int>(unsigned long)"));
    }

    #[test]
    fn c_wrappers_are_matched_by_whole_name() {
        let f = AllocFns::default();
        assert!(f.matches("xmalloc") && f.matches("g_malloc0") && f.matches("PyMem_RawMalloc"));
        assert!(
            f.matches("sqlite3Malloc") && f.matches("sqlite3DbMallocRawNN") && !f.matches("sqlite3VdbeSorterWrite")
        );
        assert!(!f.matches("xmalloc_failed") && !f.matches("my_xmalloc") && !f.matches("g_malloc_wrapper"));
    }

    #[test]
    fn user_names_add_and_none_empties_the_list() {
        let f = AllocFns::from_args(&["wl_xmalloc".into(), "arena_*".into()]);
        assert!(f.matches("wl_xmalloc") && f.matches("arena_push") && f.matches("xmalloc"));
        assert!(!f.matches("wl_xmalloc2"));
        // A C++ name is matched without its parameters.
        assert!(AllocFns::from_args(&["Pool::get".into()]).matches("Pool::get(unsigned long)"));
        let none = AllocFns::from_args(&["none".into()]);
        assert!(!none.matches("xmalloc") && !none.matches("alloc::alloc::alloc"));
        let after = AllocFns::from_args(&["none".into(), "my_alloc".into()]);
        assert!(after.matches("my_alloc") && !after.matches("operator new(unsigned long)"));
    }

    #[test]
    fn names_that_are_not_well_formed_do_not_panic() {
        let f = AllocFns::default();
        for name in ["", "<", ">", "<<>>", "< as >", "(", ")(", "operator<", "a >b", "<[T] as ", "é<ü as ß>::f"] {
            let _ = f.matches(name);
        }
    }
}
