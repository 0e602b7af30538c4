//! Typed metadata getters: `Ok(None)` when the key is absent, [`GgufError::WrongType`] when it
//! holds another type, [`GgufError::OutOfRange`] when an integer does not fit the type asked for.
//!
//! The integer getters accept any integer type whose value fits, as llama.cpp's loaders in effect
//! do for counts that writers store as u32, i32 or u64; floats are not integers, and a bool is not
//! one either. [`GgufFile::get_f32`] accepts f32 and f64 (rounded to f32). The array getters return
//! the file's own slice, so they take exactly their element type.

use crate::GgufFile;
use crate::error::{GgufError, Result};
use crate::text::cut;
use crate::value::{Array, Value};

impl GgufFile {
    fn wrong(&self, key: &str, v: &Value, expected: &'static str) -> GgufError {
        GgufError::WrongType { path: self.shown().to_string(), key: cut(key), found: v.type_name(), expected }
    }

    /// The integer at `key` if it lies in `lo..=hi` (`expected` names the type asked for).
    fn integer(&self, key: &str, lo: i128, hi: i128, expected: &'static str) -> Result<Option<i128>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let n = v.as_integer().ok_or_else(|| self.wrong(key, v, expected))?;
        if n < lo || n > hi {
            return Err(GgufError::OutOfRange {
                path: self.shown().to_string(),
                key: cut(key),
                value: n.to_string(),
                found: v.type_name(),
                expected,
            });
        }
        Ok(Some(n))
    }

    /// The string at `key`.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, v, "str")),
        }
    }

    /// The integer at `key` as a u32: a u32, or any other integer type holding 0..=u32::MAX.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        Ok(self.integer(key, 0, u32::MAX.into(), "u32")?.map(|n| n as u32))
    }

    /// The integer at `key` as a u64: any integer type holding a value of 0 or more.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        Ok(self.integer(key, 0, u64::MAX.into(), "u64")?.map(|n| n as u64))
    }

    /// The integer at `key` as an i64: any integer type holding a value in i64's range.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        Ok(self.integer(key, i64::MIN.into(), i64::MAX.into(), "i64")?.map(|n| n as i64))
    }

    /// The float at `key` as an f32: an f32, or an f64 rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong(key, v, "f32")),
        }
    }

    /// The bool at `key`.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, v, "bool")),
        }
    }

    /// The array at `key`, of any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&Array>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(key, v, "an array")),
        }
    }

    /// The array of strings at `key`.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::String(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, v, "arr[str]")),
        }
    }

    /// The array of f32 at `key`.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<&[f32]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::F32(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, v, "arr[f32]")),
        }
    }

    /// The array of i32 at `key`.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<&[i32]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::I32(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, v, "arr[i32]")),
        }
    }

    /// The array of u32 at `key`.
    pub fn get_u32_array(&self, key: &str) -> Result<Option<&[u32]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::U32(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, v, "arr[u32]")),
        }
    }
}
