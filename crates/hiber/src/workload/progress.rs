//! The progress line every workload prints, `step N checksum X t MS ...` (X in hex, MS the
//! wall clock in milliseconds, anything after MS ignored), and its one parser in Rust.
//!
//! The GPU suite's test programs (gpu/programs/) and the benchmark's (bench/programs/) print
//! the same line; the Python side parses it with `parse_progress` of bench/benchlib.py.
//! The end-to-end tests include this file (`#[path]`) rather than parse the line again, so
//! it must stay free of anything from the rest of the crate.

/// A progress line of any workload: `step N checksum X t MS ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub step: u64,
    pub checksum: u64,
    pub t_ms: u64,
}

/// One line; `None` for any other line, and for one cut short (the process was frozen
/// mid-write, or the log was read while being written), rather than misread.
pub fn parse_progress(l: &str) -> Option<Progress> {
    let mut it = l.split_whitespace();
    if it.next()? != "step" {
        return None;
    }
    let step = it.next()?.parse().ok()?;
    if it.next()? != "checksum" {
        return None;
    }
    let checksum = u64::from_str_radix(it.next()?, 16).ok()?;
    if it.next()? != "t" {
        return None;
    }
    let t_ms = it.next()?.parse().ok()?;
    Some(Progress { step, checksum, t_ms })
}

/// Every progress line of a log, in order; other and malformed lines are skipped.
pub fn progress_of(log: &str) -> Vec<Progress> {
    log.lines().filter_map(parse_progress).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse() {
        let log = "start cpu\nstep 0 checksum 00000000000000ff t 1000\nstep 1 checksum 0a t 1020 counts [1, 2]\nstep x checksum 1 t 2\ngarbage\nstep 2 checksum 0b t\nverify ok steps 2\n";
        let p = progress_of(log);
        assert_eq!(p, vec![Progress { step: 0, checksum: 255, t_ms: 1000 }, Progress { step: 1, checksum: 10, t_ms: 1020 }]);
    }

    #[test]
    fn torn_and_foreign_lines_are_skipped() {
        for l in [
            "step 3",
            "step 3 checksum",
            "step 3 checksum 0f",
            "step 3 checksum 0f t",
            "step 3 checksum zz t 5",
            "child step 3 checksum 0f t 5",
            "step 3 sum 0f t 5",
        ] {
            assert_eq!(parse_progress(l), None, "{l}");
        }
        assert_eq!(parse_progress("step 3 checksum 0f t 5 loss 2.5"), Some(Progress { step: 3, checksum: 15, t_ms: 5 }));
    }
}
