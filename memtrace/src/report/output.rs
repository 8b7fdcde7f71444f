//! Writing a report to a file (`report -o`, `diff -o`) without destroying anything: never
//! over the recording it was made from, never through a symbolic link, and over an existing
//! file only if it is an earlier memtrace report, unless `--force`.
use std::{
    fs::{self, OpenOptions},
    io::{self, Read as _, Write},
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    path::Path,
};

use anyhow::{Context as _, Result, bail};

/// How every memtrace report starts: text, JSON, HTML.
const REPORT_STARTS: [&[u8]; 4] =
    [b"memtrace report:", b"memtrace diff:", b"{\n  \"", b"<!DOCTYPE html>\n<!-- memtrace"];

fn is_report(path: &Path) -> bool {
    let mut head = [0u8; 64];
    let Ok(mut f) = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path) else {
        return false;
    };
    let n = f.read(&mut head).unwrap_or(0);
    REPORT_STARTS.iter().any(|start| head[..n].starts_with(start))
}

/// Writes `contents` to `path`, the report of the recordings `inputs`: as private as they
/// are, and under sudo the invoking user's.
pub fn write_file(path: &Path, inputs: &[&Path], contents: &[u8], force: bool) -> Result<()> {
    write_file_with(path, inputs, force, &|w| w.write_all(contents))
}

/// [`write_file`], the contents written by `write` as they are made.
pub fn write_file_with(
    path: &Path,
    inputs: &[&Path],
    force: bool,
    write: &dyn Fn(&mut dyn Write) -> io::Result<()>,
) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) => {
            for input in inputs {
                if fs::metadata(input).is_ok_and(|i| i.dev() == meta.dev() && i.ino() == meta.ino()) {
                    bail!("{} is the recording being read; write the report elsewhere", path.display());
                }
            }
            let kind = meta.file_type();
            if kind.is_dir() {
                bail!("{} is a directory", path.display());
            }
            crate::session::output::refuse_unless_replaceable(
                path,
                kind,
                force,
                &|| "exists and is not a memtrace report".to_string(),
                &|| is_report(path),
            )?;
            // Unlinking removes a symlink itself, never its target.
            fs::remove_file(path).with_context(|| format!("replacing {}", path.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    // As private as the recordings it reads (0600 as `record` writes them), its paths,
    // command lines and sizes included.
    let mode = inputs.iter().fold(0o666, |m, input| m & fs::metadata(input).map_or(0o600, |i| i.mode() & 0o666));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    // Under sudo, the user's, as `record` makes its recordings.
    crate::session::output::hand_to_invoking_user(&file);
    let mut file = io::BufWriter::with_capacity(1 << 16, file);
    let written = write(&mut file).and_then(|()| file.flush()).with_context(|| format!("writing {}", path.display()));
    if written.is_err() {
        // No partial report left behind (a full disk): the file is the one made above.
        let _ = fs::remove_file(path);
    }
    written
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn replaces_only_earlier_reports_and_never_the_recording() {
        let tmp = tempfile::Builder::new().prefix("memtrace-report-output-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let data = dir.join("memtrace.data");
        fs::write(&data, b"MEMTRACE\x01").unwrap();
        let out = dir.join("report.html");
        fs::set_permissions(&data, fs::Permissions::from_mode(0o600)).unwrap();
        write_file(&out, &[&data], b"<!DOCTYPE html>\n<!-- memtrace report -->", false).unwrap();
        assert_eq!(fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600, "as private as the recording");
        write_file(&out, &[&data], b"<!DOCTYPE html>\n<!-- memtrace again -->", false).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"<!DOCTYPE html>\n<!-- memtrace again -->");
        let err = write_file(&data, &[&data], b"x", true).unwrap_err().to_string();
        assert!(err.contains("is the recording being read"), "{err}");
        assert_eq!(fs::read(&data).unwrap(), b"MEMTRACE\x01");
        let source = dir.join("prog.c");
        fs::write(&source, b"int main;").unwrap();
        let err = write_file(&source, &[&data], b"x", false).unwrap_err().to_string();
        assert!(err.contains("not a memtrace report; use --force"), "{err}");
        write_file(&source, &[&data], b"memtrace report: x", true).unwrap();
        let link = dir.join("link.html");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        assert!(write_file(&link, &[&data], b"x", false).unwrap_err().to_string().contains("symbolic link"));
        // A write that fails half-way (a full disk) leaves no partial report.
        let full = dir.join("full.txt");
        let err = write_file_with(&full, &[&data], false, &|w| {
            w.write_all(&[b'x'; 1 << 17])?;
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("No space left on device"), "{err:#}");
        assert!(!full.exists());
    }
}
