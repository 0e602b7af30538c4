//! [`Device`]: where a tensor's elements live.

use std::fmt;

/// Where a tensor's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; operations run on the CPU backend (threaded SGEMM, plain loops).
    #[default]
    Cpu,
    /// Memory of the CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    /// Parses `cpu`, `cuda` (ordinal 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}; expected cpu, cuda or cuda:N")),
        }
    }
}
