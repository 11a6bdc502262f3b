//! Format tests: every way an image can be wrong is reported, naming the file.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::*;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("hiber-image-test-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A manifest of this process, for tests that write images.
pub(crate) fn sample_manifest() -> Manifest {
    Manifest {
        magic: MAGIC.into(),
        format: FORMAT,
        created: "2026-11-22T00:00:00Z".into(),
        host: "h".into(),
        kernel: "6.18".into(),
        criu_version: "4.1.1".into(),
        hiber_version: "0.1.0".into(),
        source: Source {
            job: Some("j".into()),
            pid: 42,
            leave_running: false,
            pid_namespace: true,
            mount_namespace: true,
            stdout: None,
            stderr: None,
            stdout_external: None,
            stderr_external: None,
            cuda_namespaces: Vec::new(),
        },
        processes: vec![crate::proctree::read_process(std::process::id() as i32).unwrap()],
        devices: Vec::new(),
        frozen_seconds: 0.5,
        parent: None,
        files: Vec::new(),
    }
}

fn write_image(root: &Path) -> PathBuf {
    let dest = root.join("img");
    let mut w = ImageWriter::create(&dest).unwrap();
    fs::write(w.criu_dir().join("pages-1.img"), vec![7u8; 100_000]).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    w.commit(sample_manifest(), &[]).unwrap();
    dest
}

#[test]
fn round_trip_verifies_and_is_private() {
    let t = TempDir::new("rt");
    let dest = write_image(&t.0);
    let img = Image::open(&dest).unwrap();
    assert_eq!(img.manifest.files.len(), 2);
    assert_eq!(img.verify().unwrap(), 100_004);
    assert_eq!(img.memory_bytes(), 100_000);
    assert_eq!(fs::metadata(&dest).unwrap().permissions().mode() & 0o777, 0o700);
    for f in ["manifest.json", "manifest.blake3", "criu/pages-1.img"] {
        assert_eq!(fs::metadata(dest.join(f)).unwrap().permissions().mode() & 0o777, 0o600, "{f}");
    }
    // No temporary directory is left beside it.
    let names: Vec<_> = fs::read_dir(&t.0).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("img")]);
}

#[test]
fn dropped_writer_leaves_nothing() {
    let t = TempDir::new("drop");
    {
        let w = ImageWriter::create(&t.0.join("img")).unwrap();
        fs::write(w.criu_dir().join("pages-1.img"), b"x").unwrap();
    }
    assert_eq!(fs::read_dir(&t.0).unwrap().count(), 0);
}

#[test]
fn existing_output_is_refused() {
    let t = TempDir::new("exists");
    fs::create_dir(t.0.join("img")).unwrap();
    assert!(matches!(ImageWriter::create(&t.0.join("img")), Err(ImageError::OutputExists(_))));
}

#[test]
fn truncated_file_is_named() {
    let t = TempDir::new("trunc");
    let dest = write_image(&t.0);
    let f = dest.join("criu/pages-1.img");
    fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(10).unwrap();
    match Image::open(&dest).unwrap().verify() {
        Err(ImageError::SizeMismatch { path, expected: 100_000, found: 10 }) => assert_eq!(path, f),
        other => panic!("{other:?}"),
    }
}

#[test]
fn altered_file_is_named() {
    let t = TempDir::new("alter");
    let dest = write_image(&t.0);
    let f = dest.join("criu/core-1.img");
    fs::write(&f, b"CORE").unwrap();
    assert!(matches!(Image::open(&dest).unwrap().verify(), Err(ImageError::ChecksumMismatch(p)) if p == f));
}

#[test]
fn missing_and_extra_files_are_named() {
    let t = TempDir::new("missing");
    let dest = write_image(&t.0);
    fs::remove_file(dest.join("criu/core-1.img")).unwrap();
    assert!(matches!(Image::open(&dest).unwrap().verify(), Err(ImageError::MissingFile(p)) if p.ends_with("criu/core-1.img")));
    let dest2 = {
        let t2 = t.0.join("second");
        fs::create_dir(&t2).unwrap();
        write_image(&t2)
    };
    fs::write(dest2.join("criu/extra.img"), b"?").unwrap();
    assert!(matches!(Image::open(&dest2).unwrap().verify(), Err(ImageError::UnexpectedFile(p)) if p.ends_with("criu/extra.img")));
}

#[test]
fn altered_or_unsealed_manifest_is_rejected() {
    let t = TempDir::new("manifest");
    let dest = write_image(&t.0);
    let mpath = dest.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mpath).unwrap();
    fs::write(&mpath, text.replacen("\"host\": \"h\"", "\"host\": \"x\"", 1)).unwrap();
    assert!(matches!(Image::open(&dest), Err(ImageError::ChecksumMismatch(p)) if p == mpath));
    fs::write(&mpath, &text).unwrap();
    Image::open(&dest).unwrap();
    fs::remove_file(dest.join(MANIFEST_SUM_FILE)).unwrap();
    assert!(matches!(Image::open(&dest), Err(ImageError::MissingFile(p)) if p.ends_with(MANIFEST_SUM_FILE)));
}

#[test]
fn other_versions_and_foreign_directories_are_rejected() {
    let t = TempDir::new("version");
    let dest = write_image(&t.0);
    let mpath = dest.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mpath).unwrap();
    for (major, minor) in [(2, 0), (1, 3), (0, 9)] {
        let bumped = text.replacen("\"major\": 1", &format!("\"major\": {major}"), 1).replacen("\"minor\": 1", &format!("\"minor\": {minor}"), 1);
        fs::write(&mpath, bumped).unwrap();
        match Image::open(&dest) {
            Err(ImageError::UnsupportedFormat { found, .. }) => assert_eq!(found, FormatVersion { major, minor }),
            other => panic!("{major}.{minor}: {other:?}"),
        }
    }
    fs::write(&mpath, b"{ not json").unwrap();
    assert!(matches!(Image::open(&dest), Err(ImageError::CorruptManifest { .. })));
    fs::write(&mpath, br#"{"magic":"ELF","format":{"major":1,"minor":0}}"#).unwrap();
    assert!(matches!(Image::open(&dest), Err(ImageError::NotAnImage(_))));
    fs::remove_file(&mpath).unwrap();
    assert!(matches!(Image::open(&dest), Err(ImageError::NotAnImage(_))));
    assert!(matches!(Image::open(&t.0.join("nope")), Err(ImageError::NotFound(_))));
    let file = t.0.join("plain-file");
    fs::write(&file, b"hello").unwrap();
    assert!(matches!(Image::open(&file), Err(ImageError::NotAnImage(_))));
}

#[test]
fn device_chunks_hashed_by_their_writer_are_trusted_for_commit_and_checked_on_restore() {
    let t = TempDir::new("known");
    let dest = t.0.join("img");
    let mut w = ImageWriter::create(&dest).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    fs::create_dir_all(w.tmp_dir().join("agent/1")).unwrap();
    let chunk = vec![3u8; 4096];
    fs::write(w.tmp_dir().join("agent/1/1.00000"), &chunk).unwrap();
    let known = FileEntry { path: "agent/1/1.00000".into(), size: 4096, blake3: blake3::hash(&chunk).to_hex().to_string(), encoding: None, fingerprint: None };
    w.commit(sample_manifest(), std::slice::from_ref(&known)).unwrap();
    let img = Image::open(&dest).unwrap();
    assert!(img.manifest.files.contains(&known));
    img.verify().unwrap();

    // A chunk altered after the checkpoint: the full verify catches it; a restore defers
    // it to the engine that streams it (which checks each chunk), but still checks the rest.
    fs::write(dest.join("agent/1/1.00000"), vec![4u8; 4096]).unwrap();
    assert!(matches!(img.verify(), Err(ImageError::ChecksumMismatch(_))));
    img.verify_except(&["agent"]).unwrap();
    fs::write(dest.join("criu/core-1.img"), b"corf").unwrap();
    assert!(matches!(img.verify_except(&["agent"]), Err(ImageError::ChecksumMismatch(_))));
    // A deferred chunk is still checked for size.
    fs::write(dest.join("criu/core-1.img"), b"core").unwrap();
    fs::write(dest.join("agent/1/1.00000"), vec![3u8; 100]).unwrap();
    assert!(matches!(img.verify_except(&["agent"]), Err(ImageError::SizeMismatch { .. })));
}

#[test]
fn a_known_entry_whose_file_changed_size_is_refused() {
    let t = TempDir::new("known-size");
    let dest = t.0.join("img");
    let mut w = ImageWriter::create(&dest).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    let known = FileEntry { path: "criu/core-1.img".into(), size: 99, blake3: "00".into(), encoding: None, fingerprint: None };
    assert!(matches!(w.commit(sample_manifest(), &[known]), Err(ImageError::SizeMismatch { .. })));
    assert!(!dest.exists());
}

#[test]
fn format_1_0_images_still_open() {
    let t = TempDir::new("v1-0");
    let dest = write_image(&t.0);
    let mpath = dest.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mpath).unwrap();
    // A 1.0 manifest: no section versions, and `uses_nvidia` where 1.1 lists device files.
    let old = text.replacen("\"minor\": 1", "\"minor\": 0", 1).replace("\"device_files\": []", "\"uses_nvidia\": false");
    assert_ne!(old, text);
    fs::write(&mpath, &old).unwrap();
    fs::write(dest.join(MANIFEST_SUM_FILE), format!("{}\n", blake3::hash(old.as_bytes()).to_hex())).unwrap();
    let img = Image::open(&dest).unwrap();
    assert_eq!(img.manifest.format, FormatVersion { major: 1, minor: 0 });
    assert!(img.manifest.processes[0].device_files.is_empty());
    let section: DeviceSection = serde_json::from_str(r#"{"engine":"cuda","state":{}}"#).unwrap();
    assert_eq!(section.version, 1, "a 1.0 section is version 1 of its engine's state");
}

#[test]
fn logs_are_handed_back_under_their_external_id_or_their_path() {
    let mut src = Source {
        job: None,
        pid: 1,
        leave_running: false,
        pid_namespace: true,
        mount_namespace: true,
        stdout: Some("/state/jobs/a/stdout.log".into()),
        stderr: Some("/state/jobs/a/stderr.log".into()),
        stdout_external: None,
        stderr_external: None,
        cuda_namespaces: Vec::new(),
    };
    // A 1.0 image: by path, without the leading '/'.
    assert_eq!(src.log_keys(), [Some("state/jobs/a/stdout.log".into()), Some("state/jobs/a/stderr.log".into())]);
    src.stdout_external = Some("file[1b:2a]".into());
    src.stderr = None;
    assert_eq!(src.log_keys(), [Some("file[1b:2a]".into()), None]);
}

/// Writes an image whose device data is `chunks` (name, bytes), as an engine does, sharing
/// with `parent` when given. Returns the image and what it shared.
fn write_chunked(dest: &Path, chunks: &[(&str, Vec<u8>)], parent: Option<&Path>) -> (PathBuf, (u64, u64)) {
    let mut w = ImageWriter::create(dest).unwrap();
    if let Some(p) = parent {
        w.share_with(p).unwrap();
    }
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    let known: Vec<FileEntry> = chunks.iter().map(|(rel, data)| chunks::write(&w, rel, data).unwrap()).collect();
    let shared = w.shared();
    w.commit(sample_manifest(), &known).unwrap();
    (dest.to_path_buf(), shared)
}

#[test]
fn an_incremental_image_shares_unchanged_chunks_and_outlives_its_parent() {
    use std::os::unix::fs::MetadataExt;
    let t = TempDir::new("incr");
    let weights = vec![3u8; 300_000];
    let (first, shared) = write_chunked(&t.0.join("first"), &[("agent/1/1.00000", weights.clone()), ("agent/1/2.00000", vec![1u8; 1000])], None);
    assert_eq!(shared, (0, 0));
    assert_eq!(Image::open(&first).unwrap().manifest.parent, None);
    // The weights did not change, the state did, and a new allocation appeared with the
    // weights' bytes under another name: shared by content, not by name.
    let (second, shared) = write_chunked(
        &t.0.join("second"),
        &[("agent/1/1.00000", weights.clone()), ("agent/1/2.00000", vec![2u8; 1000]), ("agent/1/9.00000", weights.clone())],
        Some(&first),
    );
    assert_eq!(shared, (2, 600_000));
    let ino = |p: PathBuf| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(first.join("agent/1/1.00000")), ino(second.join("agent/1/1.00000")), "one file, two names");
    assert_eq!(ino(first.join("agent/1/1.00000")), ino(second.join("agent/1/9.00000")));
    assert_ne!(ino(first.join("agent/1/2.00000")), ino(second.join("agent/1/2.00000")), "the changed chunk is written");
    let img = Image::open(&second).unwrap();
    let p = img.manifest.parent.clone().unwrap();
    assert_eq!((p.shared_files, p.shared_bytes), (2, 600_000));
    assert_eq!(p.path, fs::canonicalize(&first).unwrap().display().to_string());
    assert_eq!(p.manifest_blake3, fs::read_to_string(first.join("manifest.blake3")).unwrap().trim());
    // Removing the parent leaves the child whole: every file is there, verified.
    fs::remove_dir_all(&first).unwrap();
    assert_eq!(Image::open(&second).unwrap().verify().unwrap(), 300_000 * 2 + 1000 + 4);
    assert_eq!(fs::read(second.join("agent/1/9.00000")).unwrap(), weights);
}

#[test]
fn a_chunk_known_by_its_fingerprint_is_shared_without_its_data() {
    use std::os::unix::fs::MetadataExt;
    let t = TempDir::new("fingerprint");
    // The parent as the agent engine writes it: each chunk's entry carries the fingerprint
    // its data had on the GPU.
    let mut w = ImageWriter::create(&t.0.join("first")).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    let weights = vec![7u8; 8192];
    let mut a = chunks::write(&w, "agent/1/1.00000", &weights).unwrap();
    a.fingerprint = Some("fp-weights".into());
    let mut b = chunks::write(&w, "agent/1/2.00000", &[1u8; 4096]).unwrap();
    b.fingerprint = Some("fp-state".into());
    w.commit(sample_manifest(), &[a.clone(), b]).unwrap();
    let first = t.0.join("first");
    assert_eq!(Image::open(&first).unwrap().manifest.files.iter().filter(|f| f.fingerprint.is_some()).count(), 2, "kept in the manifest");

    let mut w = ImageWriter::create(&t.0.join("second")).unwrap();
    assert!(!w.parent_fingerprint("fp-weights"), "no parent yet");
    w.share_with(&first).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    assert!(w.parent_fingerprint("fp-weights") && w.parent_fingerprint("fp-state"));
    assert!(!w.parent_fingerprint("fp-other"));
    assert_eq!(w.reuse_fingerprint("agent/1/3.00000", "fp-other").unwrap(), None);
    // Shared under another name, with the parent's checksum and size: the data itself is
    // never handed over.
    let e = w.reuse_fingerprint("agent/1/5.00000", "fp-weights").unwrap().expect("shared");
    assert_eq!((e.path.as_str(), e.size, e.blake3.as_str(), e.fingerprint.as_deref()), ("agent/1/5.00000", a.size, a.blake3.as_str(), Some("fp-weights")));
    assert_eq!(w.shared(), (1, 8192));
    // The parent's other chunk altered after its manifest was read: not shared, so the
    // caller writes it (or, holding no copy, fails the checkpoint).
    fs::write(first.join("agent/1/2.00000"), [2u8; 4096]).unwrap();
    assert_eq!(w.reuse_fingerprint("agent/1/2.00000", "fp-state").unwrap(), None);
    assert!(!t.0.join(w.tmp_dir()).join("agent/1/2.00000").exists(), "no half-made link left behind");
    w.commit(sample_manifest(), &[e]).unwrap();
    let second = t.0.join("second");
    assert_eq!(fs::metadata(first.join("agent/1/1.00000")).unwrap().ino(), fs::metadata(second.join("agent/1/5.00000")).unwrap().ino());
    let img = Image::open(&second).unwrap();
    assert_eq!(img.manifest.files.iter().find(|f| f.path == "agent/1/5.00000").unwrap().fingerprint.as_deref(), Some("fp-weights"));
    fs::remove_dir_all(&first).unwrap();
    img.verify().unwrap();
    assert_eq!(fs::read(second.join("agent/1/5.00000")).unwrap(), weights);
}

#[test]
fn a_parent_that_is_no_image_is_refused() {
    let t = TempDir::new("badparent");
    fs::create_dir_all(t.0.join("junk")).unwrap();
    let mut w = ImageWriter::create(&t.0.join("img")).unwrap();
    assert!(matches!(w.share_with(&t.0.join("junk")), Err(ImageError::NotAnImage(_))));
    assert!(matches!(w.share_with(&t.0.join("nothing")), Err(ImageError::NotFound(_))));
}

#[test]
fn a_parent_chunk_changed_since_is_written_not_shared() {
    let t = TempDir::new("changed");
    let (first, _) = write_chunked(&t.0.join("first"), &[("agent/1/1.00000", vec![5u8; 4096])], None);
    let mut w = ImageWriter::create(&t.0.join("second")).unwrap();
    w.share_with(&first).unwrap();
    // Altered after the parent's manifest was read (same size, one byte): not shared, and
    // the new image holds the right bytes.
    let mut bytes = vec![5u8; 4096];
    bytes[100] = 6;
    fs::write(first.join("agent/1/1.00000"), &bytes).unwrap();
    let e = chunks::write(&w, "agent/1/1.00000", &[5u8; 4096]).unwrap();
    assert_eq!(w.shared(), (0, 0));
    w.commit(sample_manifest(), &[e]).unwrap();
    assert_eq!(fs::read(t.0.join("second/agent/1/1.00000")).unwrap(), vec![5u8; 4096]);
    assert_eq!(fs::read(first.join("agent/1/1.00000")).unwrap(), bytes, "the parent's file is left as it is");
    Image::open(&t.0.join("second")).unwrap().verify().unwrap();
}

#[test]
fn compressed_chunks_read_back_and_need_format_1_2() {
    let t = TempDir::new("zstd");
    let dest = t.0.join("img");
    let mut w = ImageWriter::create(&dest).unwrap();
    w.compress(1);
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    // A pattern compresses; blake3's output stream does not.
    let pattern: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let mut noise = vec![0u8; 300_000];
    blake3::Hasher::new().finalize_xof().fill(&mut noise);
    let a = chunks::write(&w, "agent/1/1.00000", &pattern).unwrap();
    let b = chunks::write(&w, "agent/1/2.00000", &noise).unwrap();
    assert_eq!(a.encoding.as_deref(), Some("zstd"));
    assert!(a.size < pattern.len() as u64 / 10, "{} bytes stored", a.size);
    assert_eq!((b.encoding.as_deref(), b.size), (None, noise.len() as u64), "stored as it is when zstd does not help");
    // Read back before the commit (a partial image: no sums), then from the image.
    let mut buf = vec![0u8; pattern.len()];
    chunks::read(w.tmp_dir(), "agent/1/1.00000", &mut buf, None).unwrap();
    assert_eq!(buf, pattern);
    w.commit(sample_manifest(), &[a.clone(), b]).unwrap();
    let img = Image::open(&dest).unwrap();
    assert_eq!(img.manifest.format, FORMAT_COMPRESSED);
    img.verify().unwrap();
    let sums: std::collections::HashMap<String, String> = img.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect();
    let mut buf = vec![0u8; pattern.len()];
    chunks::read(&dest, "agent/1/1.00000", &mut buf, Some(&sums)).unwrap();
    assert_eq!(buf, pattern);
    let mut buf = vec![0u8; noise.len()];
    chunks::read(&dest, "agent/1/2.00000", &mut buf, Some(&sums)).unwrap();
    assert_eq!(buf, noise);
    // The wrong length, or a damaged frame, is an error, not data.
    let mut short = vec![0u8; pattern.len() - 1];
    assert!(chunks::read(&dest, "agent/1/1.00000", &mut short, None).unwrap_err().contains("zstd"));
    let path = dest.join("agent/1/1.00000");
    let mut bytes = fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(&path, &bytes).unwrap();
    let mut buf = vec![0u8; pattern.len()];
    assert!(chunks::read(&dest, "agent/1/1.00000", &mut buf, Some(&sums)).unwrap_err().contains("checksum"));
}

#[test]
fn uncompressed_images_stay_format_1_1() {
    let t = TempDir::new("fmt11");
    let (img, _) = write_chunked(&t.0.join("img"), &[("agent/1/1.00000", vec![9u8; 5000])], None);
    assert_eq!(Image::open(&img).unwrap().manifest.format, FORMAT);
}

#[test]
fn a_chunk_read_in_pieces_is_checked_whole() {
    let t = TempDir::new("pieces");
    // Longer than a few of the pieces read_timed hashes as it reads, and not a multiple.
    let mut data = vec![0u8; (3 << 20) + 12345];
    blake3::Hasher::new().finalize_xof().fill(&mut data);
    let (img, _) = write_chunked(&t.0.join("img"), &[("agent/1/1.00000", data.clone())], None);
    let image = Image::open(&img).unwrap();
    let sums: std::collections::HashMap<String, String> = image.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect();
    let mut buf = vec![0u8; data.len()];
    chunks::read(&img, "agent/1/1.00000", &mut buf, Some(&sums)).unwrap();
    assert_eq!(buf, data);
    // One byte changed in any piece, the first or the last, fails the whole chunk.
    for at in [0, data.len() - 1] {
        let path = img.join("agent/1/1.00000");
        let mut bytes = data.clone();
        bytes[at] ^= 1;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(&path, &bytes).unwrap();
        let err = chunks::read(&img, "agent/1/1.00000", &mut buf, Some(&sums)).unwrap_err();
        assert!(err.contains("checksum"), "byte {at}: {err}");
    }
    // A chunk the manifest does not name is refused, not read unchecked.
    let none = std::collections::HashMap::new();
    assert!(chunks::read(&img, "agent/1/1.00000", &mut buf, Some(&none)).unwrap_err().contains("not in the manifest"));
}

/// A crafted manifest (its checksum made to match) that names a file outside the image is
/// reported as such, not as a missing file.
#[test]
fn a_manifest_naming_a_path_outside_the_image_is_refused() {
    let t = TempDir::new("escape");
    let dest = write_image(&t.0);
    let original = Image::open(&dest).unwrap().manifest;
    for bad in ["../../etc/passwd", "/etc/passwd", "criu/../../x", "criu//pages-1.img", ""] {
        let mut m = original.clone();
        m.files[0].path = bad.into();
        let text = serde_json::to_vec_pretty(&m).unwrap();
        fs::write(dest.join(MANIFEST_FILE), &text).unwrap();
        fs::write(dest.join(MANIFEST_SUM_FILE), format!("{}\n", blake3::hash(&text).to_hex())).unwrap();
        match Image::open(&dest) {
            Err(ImageError::CorruptManifest { reason, .. }) => assert!(reason.contains("not a path inside the image"), "{bad}: {reason}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn chunks_written_on_several_threads_come_back_in_order_and_verify() {
    let t = TempDir::new("many");
    let mut w = ImageWriter::create(&t.0.join("img")).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    let data: Vec<Vec<u8>> = (0..11u8).map(|k| if k == 4 { vec![0u8; 5000] } else { vec![k; 3000 + k as usize] }).collect();
    let items: Vec<(String, &[u8])> = data.iter().enumerate().map(|(k, d)| (format!("opencl/1/1.{k:05}"), d.as_slice())).collect();
    let entries = chunks::write_many(&w, &items).unwrap();
    let names: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, items.iter().map(|(r, _)| r.as_str()).collect::<Vec<_>>(), "in the order given");
    w.commit(sample_manifest(), &entries).unwrap();
    let img = t.0.join("img");
    Image::open(&img).unwrap().verify().unwrap();
    for (rel, d) in &items {
        assert_eq!(fs::read(img.join(rel)).unwrap(), *d);
    }
    // A chunk that cannot be written fails the whole call.
    let w = ImageWriter::create(&t.0.join("img2")).unwrap();
    fs::write(w.criu_dir().join("core-1.img"), b"core").unwrap();
    let bad: Vec<(String, &[u8])> = vec![("opencl/1/ok.00000".into(), &data[1][..]), ("criu/core-1.img/under-a-file".into(), &data[2][..])];
    assert!(chunks::write_many(&w, &bad).is_err());
}
