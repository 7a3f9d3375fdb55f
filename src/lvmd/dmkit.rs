//! What lvmd asks of the dmkit daemon, through its control socket with the
//! same verbs as the `dmkit` command: one connection per request.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;

/// A daemon's run directory.
#[derive(Clone, Debug)]
pub struct Dmkit {
    pub run_dir: PathBuf,
}

/// A thin pool as its table and status say.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolUsage {
    pub block_bytes: u64,
    pub data_blocks: u64,
    pub used_data_blocks: u64,
    pub meta_blocks: u64,
    pub used_meta_blocks: u64,
}

impl PoolUsage {
    pub fn size_bytes(&self) -> u64 {
        self.data_blocks.saturating_mul(self.block_bytes)
    }
    pub fn data_percent(&self) -> f64 {
        percent(self.used_data_blocks, self.data_blocks)
    }
    pub fn metadata_percent(&self) -> f64 {
        percent(self.used_meta_blocks, self.meta_blocks)
    }
}

fn percent(used: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        used as f64 * 100.0 / total as f64
    }
}

impl Dmkit {
    /// Send one request; its output, or its error text.
    pub fn call(&self, words: &[&str]) -> Result<String, String> {
        let sock = self.run_dir.join("control.sock");
        let mut s =
            UnixStream::connect(&sock).map_err(|e| format!("the dmkit daemon at {}: {e}", sock.display()))?;
        let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        let (ok, out, err) = crate::client::call(&mut s, &words, &[])
            .map_err(|e| format!("the dmkit daemon at {}: {e}", sock.display()))?;
        if ok {
            Ok(out)
        } else {
            Err(err.trim_end().to_string())
        }
    }

    pub fn exists(&self, name: &str) -> Result<bool, String> {
        let out = self.call(&["ls"])?;
        Ok(out.lines().any(|l| l.split_whitespace().next() == Some(name)))
    }

    /// The device's target types, in table order.
    pub fn target_types(&self, name: &str) -> Result<Vec<String>, String> {
        let t = self.call(&["table", name])?;
        Ok(t.lines()
            .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
            .collect())
    }

    pub fn message(&self, name: &str, msg: &str) -> Result<String, String> {
        self.call(&["message", name, "0", msg])
    }

    pub fn create(&self, name: &str, table: &str, read_only: bool) -> Result<(), String> {
        let mut w = vec!["create", name, "--table", table];
        if read_only {
            w.push("--readonly");
        }
        self.call(&w).map(drop)
    }

    /// Load TABLE and make it live.
    pub fn reload(&self, name: &str, table: &str) -> Result<(), String> {
        self.call(&["load", name, "--table", table])?;
        self.call(&["resume", name]).map(drop)
    }

    pub fn suspend(&self, name: &str) -> Result<(), String> {
        self.call(&["suspend", name]).map(drop)
    }

    pub fn resume(&self, name: &str) -> Result<(), String> {
        self.call(&["resume", name]).map(drop)
    }

    pub fn remove(&self, name: &str) -> Result<(), String> {
        self.call(&["remove", name]).map(drop)
    }

    /// (major, minor) of a device.
    pub fn devnum(&self, name: &str) -> Result<(u32, u32), String> {
        let out = self.call(&[
            "info",
            "-c",
            "--noheadings",
            "-o",
            "major,minor",
            "--separator",
            ":",
            name,
        ])?;
        let mut it = out.trim().split(':').map(|s| s.trim().parse::<u32>());
        match (it.next(), it.next()) {
            (Some(Ok(a)), Some(Ok(b))) => Ok((a, b)),
            _ => Err(format!("{name}: unexpected device numbers '{}'", out.trim())),
        }
    }

    /// A thin pool's table line: (its metadata device as the table names it,
    /// its data block size in sectors).
    pub fn pool_table(&self, pool: &str) -> Result<(String, u64), String> {
        let table = self.call(&["table", pool])?;
        let w: Vec<&str> = table.split_whitespace().collect();
        if w.get(2) != Some(&"thin-pool") {
            return Err(format!("{pool}: not a thin-pool device"));
        }
        match (w.get(3), w.get(5).and_then(|s| s.parse().ok())) {
            (Some(meta), Some(block_sectors)) => Ok((meta.to_string(), block_sectors)),
            _ => Err(format!("{pool}: not a thin-pool table: '{}'", table.trim())),
        }
    }

    /// A thin pool's size and use (its table's block size, its status's counts).
    pub fn pool_usage(&self, pool: &str) -> Result<PoolUsage, String> {
        let (_, block_sectors) = self.pool_table(pool)?;
        let status = self.call(&["status", pool])?;
        let s: Vec<&str> = status.split_whitespace().collect();
        let frac = |i: usize| -> Option<(u64, u64)> {
            let (a, b) = s.get(i)?.split_once('/')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        };
        match (frac(4), frac(5)) {
            (Some((um, tm)), Some((ud, td))) => Ok(PoolUsage {
                block_bytes: block_sectors * 512,
                data_blocks: td,
                used_data_blocks: ud,
                meta_blocks: tm,
                used_meta_blocks: um,
            }),
            _ => Err(format!(
                "{pool}: its status '{}' is not a live pool's",
                status.trim()
            )),
        }
    }

    /// The thin device ids a pool holds.
    pub fn thin_ids(&self, pool: &str) -> Result<Vec<u64>, String> {
        let out = self.message(pool, "thin_ls -o DEV --no-headers")?;
        out.split_whitespace()
            .map(|w| {
                w.parse::<u64>()
                    .map_err(|_| format!("{pool}: thin_ls printed '{w}'"))
            })
            .collect()
    }
}
