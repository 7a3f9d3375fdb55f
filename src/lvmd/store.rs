//! lvmd's records: one file per volume (DIR/NAME.json), with the step a change
//! to it had reached. A record is written whole to a new file, synced, renamed
//! over the old one and the directory synced, before the step it announces is
//! taken; so after a crash anywhere the records name every volume that may
//! exist in a pool, and lvmd finishes or undoes what it finds half done before
//! it serves (see `super::Lvmd::recover`). One file per volume keeps a change's
//! cost the same with ten volumes or ten thousand.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where a volume's last change stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Its thin device and dmkit device may exist in part: undone at recovery.
    Creating,
    /// Made and answered for.
    Ready,
    /// Going: finished at recovery.
    Removing,
    /// Growing to `size_bytes`: finished at recovery.
    Resizing,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Volume {
    pub device_class: String,
    /// The thin device id in the class's pool.
    pub dev_id: u64,
    pub size_bytes: u64,
    #[serde(default)]
    pub tags: Vec<String>,
    /// The volume this one is a snapshot of (at the time it was taken).
    #[serde(default)]
    pub origin: Option<String>,
    #[serde(default)]
    pub read_only: bool,
    pub step: Step,
}

/// The records directory and what it holds.
pub struct Store {
    dir: PathBuf,
    pub volumes: BTreeMap<String, Volume>,
}

/// The largest record read back.
const MAX_BYTES: u64 = 1 << 20;

impl Store {
    /// Open DIR (made if missing). A record that cannot be read or does not
    /// parse is an error naming it, never skipped: its volume would leak.
    /// `valid` says which file names are volume names.
    pub fn open(dir: &Path, valid: impl Fn(&str) -> bool) -> Result<Store, String> {
        let at = |e: std::io::Error| format!("{}: {e}", dir.display());
        std::fs::create_dir_all(dir).map_err(at)?;
        let mut volumes = BTreeMap::new();
        for e in std::fs::read_dir(dir).map_err(at)? {
            let e = e.map_err(at)?;
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json") else {
                continue; // a record being written when lvmd stopped (NAME.json.new)
            };
            let path = e.path();
            if !valid(name) {
                return Err(format!(
                    "{}: not a volume's record (its name is no volume name)",
                    path.display()
                ));
            }
            let len = e.metadata().map_err(at)?.len();
            if len > MAX_BYTES {
                return Err(format!(
                    "{}: {len} bytes, more than a record holds",
                    path.display()
                ));
            }
            let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let v: Volume = serde_json::from_slice(&text)
                .map_err(|e| format!("{}: not a lvmd record: {e}", path.display()))?;
            volumes.insert(name.to_string(), v);
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            volumes,
        })
    }

    /// A marker file of lvmd's beside the records (no `.json`: not a record),
    /// made durable or removed durably.
    pub fn mark(&self, marker: &str, set: bool) -> Result<(), String> {
        let path = self.dir.join(marker);
        let r = if set {
            std::fs::File::create(&path).and_then(|f| f.sync_all())
        } else {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            }
        };
        r.map_err(|e| format!("{}: {e}", path.display()))?;
        self.sync_dir()
    }

    pub fn marked(&self, marker: &str) -> bool {
        self.dir.join(marker).exists()
    }

    fn sync_dir(&self) -> Result<(), String> {
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| format!("syncing {}: {e}", self.dir.display()))
    }

    /// Make NAME's record durable as `v`.
    pub fn put(&mut self, name: &str, v: Volume) -> Result<(), String> {
        let path = self.dir.join(format!("{name}.json"));
        let fail = |e: std::io::Error| format!("writing {}: {e}", path.display());
        let text = serde_json::to_vec_pretty(&v).map_err(|e| format!("encoding {name}'s record: {e}"))?;
        let tmp = self.dir.join(format!("{name}.json.new"));
        let mut f = std::fs::File::create(&tmp).map_err(fail)?;
        f.write_all(&text).map_err(fail)?;
        f.sync_all().map_err(fail)?;
        std::fs::rename(&tmp, &path).map_err(fail)?;
        self.sync_dir()?;
        self.volumes.insert(name.to_string(), v);
        Ok(())
    }

    /// Forget NAME, durably.
    pub fn remove(&mut self, name: &str) -> Result<(), String> {
        let path = self.dir.join(format!("{name}.json"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing {}: {e}", path.display())),
        }
        self.sync_dir()?;
        self.volumes.remove(name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_back_as_saved_and_garbage_is_not_taken_for_empty() {
        let dir = std::env::temp_dir().join(format!("lvmd-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let any = |_: &str| true;
        let mut s = Store::open(&dir, any).expect("open");
        let v = Volume {
            device_class: "thin".into(),
            dev_id: 6,
            size_bytes: 1 << 30,
            tags: vec!["a".into()],
            origin: None,
            read_only: false,
            step: Step::Creating,
        };
        s.put("v", v.clone()).expect("put");
        s.put("w", v.clone()).expect("put");
        s.remove("w").expect("remove");
        assert_eq!(Store::open(&dir, any).expect("reopen").volumes, s.volumes);
        std::fs::write(dir.join("x.json"), b"{\"dev_id\": 3").expect("write");
        let e = Store::open(&dir, any).err().expect("garbage refused");
        assert!(e.contains("not a lvmd record"), "{e}");
        std::fs::remove_file(dir.join("x.json")).expect("rm");
        let e = Store::open(&dir, |n| n != "v").err().expect("a bad name refused");
        assert!(e.contains("no volume name"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
