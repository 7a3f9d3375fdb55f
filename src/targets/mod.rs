//! Targets: each owns its table arguments, status line, messages and map
//! function, and declares its [`TargetType`] once; [`types`] lists them for the
//! registry. The interface they implement is `crate::mapper`'s.

use crate::mapper::TargetType;

/// Declares each target's module and lists its types for [`types`], one line a
/// module: `module => its TargetType constants;` (a line without a module lists
/// a type of the core's).
macro_rules! targets {
    ($($($module:ident)? => $($ty:path),+;)*) => {
        $($(pub mod $module;)?)*

        /// Every target type this build knows, in the order `dmsetup targets` lists them.
        pub fn types() -> &'static [TargetType] {
            const TYPES: &[TargetType] = &[$($($ty,)+)*];
            TYPES
        }
    };
}

targets! {
    striped => striped::TYPE;
    linear => linear::TYPE;
    => crate::mapper::error::TYPE;
    zero => zero::TYPE;
    flakey => flakey::TYPE;
    delay => delay::TYPE;
    thin => thin::pool::TYPE, thin::device::TYPE;
    snapshot => snapshot::ORIGIN_TYPE, snapshot::SNAPSHOT_TYPE, snapshot::MERGE_TYPE;
    writecache => writecache::TYPE;
    era => era::TYPE;
    cache => cache::TYPE;
    crypt => crypt::TYPE;
    verity => verity::TYPE;
    log_writes => log_writes::TYPE;
    raid => raid::TYPE;
    integrity => integrity::TYPE;
    xor => xor::TYPE;
    cdp => cdp::TYPE, cdp::POINT_TYPE;
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn repo(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }

    /// A text's lines without their indentation, blank lines left out.
    fn lines(text: &str) -> Vec<&str> {
        text.lines().map(str::trim).filter(|l| !l.is_empty()).collect()
    }

    fn rust_files(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = read(&path);
                out.push((path, text));
            }
        }
    }

    /// Every Rust block docs/targets.md shows is code the crate builds: its lines
    /// stand, in order and together, in a file under src/ (so the guide cannot
    /// drift from the interface it teaches).
    #[test]
    fn the_target_guides_code_is_code_the_crate_builds() {
        let guide = read(&repo("docs/targets.md"));
        let mut sources = Vec::new();
        rust_files(&repo("src"), &mut sources);
        let mut shown = 0;
        for block in guide.split("```rust\n").skip(1) {
            let code = block.split("```").next().unwrap_or_default();
            let want = lines(code);
            assert!(!want.is_empty(), "docs/targets.md: an empty Rust block");
            let home = sources
                .iter()
                .find(|(_, text)| lines(text).windows(want.len()).any(|w| w == want.as_slice()));
            assert!(
                home.is_some(),
                "docs/targets.md shows code that no file under src/ holds:\n{code}"
            );
            shown += 1;
        }
        assert!(shown >= 3, "docs/targets.md shows {shown} Rust blocks");
    }

    /// The manual's list of targets names every type this build has.
    #[test]
    fn the_manual_lists_every_target_type() {
        let manual = read(&repo("docs/manual/dmsetup.md"));
        let section = manual
            .split("\n## Targets\n")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .expect("docs/manual/dmsetup.md: a section '## Targets'");
        for t in crate::targets::types() {
            assert!(
                section.contains(&format!("`{}`", t.name)),
                "docs/manual/dmsetup.md's Targets section does not name `{}`",
                t.name
            );
        }
    }
}
