// Audio worklets of the page: `capture` cuts the microphone into 80 ms chunks for the WebSocket,
// `player` plays the assistant's chunks back to back from a queue (silence only on underrun).

class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.chunk = new Float32Array(options.processorOptions.chunk);
    this.filled = 0;
  }
  process(inputs) {
    const input = inputs[0][0];
    if (!input) return true;
    let read = 0;
    while (read < input.length) {
      const n = Math.min(input.length - read, this.chunk.length - this.filled);
      this.chunk.set(input.subarray(read, read + n), this.filled);
      this.filled += n;
      read += n;
      if (this.filled === this.chunk.length) {
        this.port.postMessage(this.chunk.slice());
        this.filled = 0;
      }
    }
    return true;
  }
}

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0;
    this.buffered = 0;
    this.started = false;
    this.port.onmessage = (e) => {
      // 'clear': drop everything queued, at once (a barge-in), saying how much that was;
      // 'depth': say how much is queued (samples)
      if (e.data === 'clear' || e.data === 'depth') this.port.postMessage({depth: this.buffered});
      if (e.data === 'clear') { this.queue = []; this.offset = 0; this.buffered = 0; this.started = false; }
      if (typeof e.data === 'string') return;
      this.queue.push(e.data);
      this.buffered += e.data.length;
    };
  }
  process(inputs, outputs) {
    const out = outputs[0][0];
    // Wait for two chunks before starting, so network jitter does not cut the speech.
    if (!this.started && this.buffered >= 2 * 1920) this.started = true;
    let written = 0;
    while (this.started && written < out.length && this.queue.length) {
      const head = this.queue[0];
      const n = Math.min(out.length - written, head.length - this.offset);
      out.set(head.subarray(this.offset, this.offset + n), written);
      written += n;
      this.offset += n;
      this.buffered -= n;
      if (this.offset === head.length) { this.queue.shift(); this.offset = 0; }
    }
    if (written < out.length) { out.fill(0, written); if (!this.queue.length) this.started = false; }
    return true;
  }
}

registerProcessor('capture', Capture);
registerProcessor('player', Player);
