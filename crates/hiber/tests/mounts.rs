//! A job's mount namespace is a copy of hiber's, with whatever the host has mounted: the
//! shapes here must not keep a job from being restored. In a test binary of its own, as its
//! mounts are in the namespace of every job started meanwhile.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn sh(cmd: &str) {
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    assert!(out.status.success(), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Checkpoints job `name` (stopping it), restores it and checks it finishes on its
/// trajectory.
fn round_trip(h: &Hiber, name: &str) {
    h.start(name, &["cpu", "--steps", "120", "--mem-mib", "8"]);
    h.wait_step(name, 5);
    let image = h.images_dir().join(name);
    h.ok(&["checkpoint", name, "--out", image.to_str().unwrap()]);
    let before = h.progress(name);
    let copy = format!("{name}-r");
    h.ok(&["restore", image.to_str().unwrap(), "--name", &copy]);
    h.assert_verified(&copy, Duration::from_secs(60));
    assert_continues(&before, &h.progress(&copy), before.last().unwrap().0 + 1);
}

/// Bind-mounted files from filesystems the job cannot otherwise see: Docker's /etc/hosts
/// in a container (a file of the host's disk), and the nsfs file `ip netns add` mounts
/// under /run/netns. CRIU takes each as an external mount, and before hiber's patch 0005
/// its restore failed ("mnt-v2: Failed to open_tree PATH/: Not a directory").
#[test]
fn bind_mounted_files_of_the_host_do_not_stop_a_restore() {
    let h = Hiber::new("mounts");
    let (fs, file, target) = (h.scratch.join("fs"), h.scratch.join("fs/hosts"), h.scratch.join("hosts"));
    std::fs::create_dir_all(&fs).unwrap();
    std::fs::write(&target, "").unwrap();
    sh(&format!(
        "mount -t tmpfs tmpfs {0} && echo '127.0.0.1 here' > {1} && mount --bind {1} {2} && umount -l {0}",
        fs.display(),
        file.display(),
        target.display()
    ));
    let netns = format!("hiber-mounts-{}", std::process::id());
    sh(&format!("ip netns add {netns}"));
    let result = std::panic::catch_unwind(|| round_trip(&h, "bound"));
    let _ = Command::new("umount").arg(&target).status();
    let _ = Command::new("ip").args(["netns", "del", &netns]).status();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// A checkpoint's staging area (a tmpfs under some state directory's `stage/`, here another
/// hiber's) mounted on the host while a job starts: the job's mount namespace, a copy of the
/// host's, leaves it out. Before, the job kept it for good, with the other job's memory in
/// it: CRIU dumped it with the job, and once it was unmounted and its directory gone, the
/// restore failed ("mnt-v2: Can't stat mountpoint"; seen when two test binaries ran at once).
#[test]
fn another_checkpoint_s_staging_area_is_not_the_job_s() {
    let h = Hiber::new("mounts-stage");
    let other = h.scratch.join("other-state");
    let stage = other.join("stage/4242-4242-0");
    std::fs::create_dir_all(&stage).unwrap();
    sh(&format!("mount -t tmpfs -o size=1m,mode=0700 tmpfs {}", stage.display()));
    sh(&format!("echo pages > {}/pages-1.img", stage.display()));
    let pid = h.start("staged", &["cpu", "--steps", "120", "--mem-mib", "8"]);
    let seen = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    sh(&format!("umount {}", stage.display()));
    std::fs::remove_dir_all(&other).unwrap();
    assert!(!seen.contains("4242-4242-0"), "the job does not see the staging area:\n{seen}");
    h.wait_step("staged", 5);
    let image = h.images_dir().join("staged");
    h.ok(&["checkpoint", "staged", "--out", image.to_str().unwrap()]);
    let before = h.progress("staged");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "staged-r"]);
    h.assert_verified("staged-r", Duration::from_secs(60));
    assert_continues(&before, &h.progress("staged-r"), before.last().unwrap().0 + 1);
}
